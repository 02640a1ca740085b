"""Client-server mode at full size (slow): the real Router on a real Ray cluster, where device
sessions share verify calls with ordinary HTTP requests; and SmolLM2-135M-Instruct with the
packaged MoA drafter, whose greedy float32 output through the link equals plain target decoding."""

import contextlib
import io
import json
import threading

import httpx
import pytest

from moa_serve.app.http import create_app
from moa_serve.cli import main, prompt_tokens
from moa_serve.client import DeviceDrafter, RemoteGenerator, Transport
from moa_serve.engine.in_process import SpeculativeEngine
from moa_serve.model_files import read_config
from tests.conftest import SMOLLM
from tests.support.cs_harness import Server, Uvicorn, free_port


def test_router_on_ray_serves_device_sessions_beside_http_requests(stories_path, stories_drafter):
    ray = pytest.importorskip("ray")
    from ray import serve

    from moa_serve.deployments.app import build_app

    pool = {"ray_actor_options": {"num_cpus": 0.25}, "torch_threads": 1, "max_sessions": 8}
    args = {
        "target": str(stories_path),
        "drafter": str(stories_drafter),
        "dtype": "float32",
        "num_speculative_tokens": 3,
        "router": {"ray_actor_options": {"num_cpus": 0}, "session_groups": 1, "max_sessions_per_round": 8},
        "verifier_pool": pool,
        "drafter_pool": pool,
    }
    port = free_port()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)  # a cluster of its own
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(args), name="moa", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        engine = SpeculativeEngine.load(str(stories_path), None, "float32")
        device = DeviceDrafter.load(str(stories_drafter), str(stories_path), "float32", 512)
        prompts = [device.tokenizer.encode(p) for p in ("Once upon a time", "The little dog")]
        refs = [r.token_ids for r in engine.generate(prompts, 32, ignore_eos=True)]
        http_out = {}

        def http_user():  # an ordinary user at the same time, through the same rounds
            with httpx.Client(base_url=url, timeout=120) as c:
                http_out["r"] = c.post(
                    "/v1/generate", json={"prompt": "The little dog", "max_tokens": 32, "ignore_eos": True}
                ).json()

        user = threading.Thread(target=http_user)
        user.start()
        gen = RemoteGenerator(device, Transport(url), num_speculative_tokens=3)
        res = gen.generate(prompts[0], 32, ignore_eos=True)
        user.join(timeout=300)
        assert res.token_ids == refs[0] and res.offline_tokens == 0
        assert http_out["r"]["token_ids"] == refs[1]
        stats = httpx.get(f"{url}/v1/stats", timeout=30).json()
        assert stats["client_server"]["created"] == 1 and stats["client_server"]["rounds"] == res.rounds
        assert stats["completed"] >= 1

        # a Router that drafts its own sessions by prompt lookup (no drafter pool) and serves
        # devices the MoA checkpoint named by client_drafter; the device puts lookup in front of it.
        # As local-cpu.yaml, the Router runs inside the Gateway (router.in_gateway)
        lookup_args = {
            **args,
            "drafter": "lookup",
            "client_drafter": str(stories_drafter),
            "router": {**args["router"], "in_gateway": True},
        }
        lookup_args.pop("drafter_pool")
        serve.run(build_app(lookup_args), name="moa", route_prefix="/")
        ident = httpx.get(f"{url}/v1/cs", timeout=30).json()
        assert ident["drafter"] == device.fingerprints["drafter"] and ident["drafter_kind"] == "moa"
        hybrid = DeviceDrafter.load(f"hybrid:{stories_drafter}", str(stories_path), "float32", 512)
        assert RemoteGenerator(hybrid, Transport(url)).handshake()["drafter"] == ident["drafter"]
        user = threading.Thread(target=http_user)
        user.start()
        run = RemoteGenerator(device, Transport(url), num_speculative_tokens=3).start(prompts[0], 32, ignore_eos=True)
        for _ in run:
            pass
        res = run.result()
        user.join(timeout=300)
        assert res.token_ids == refs[0] and res.offline_tokens == 0
        # the verifier computed the client drafter's features for the device: it holds them all
        # but the last committed position's (whose feature comes with the next round)
        assert run.features.end == len(prompts[0]) + 32 - 1
        assert http_out["r"]["token_ids"] == refs[1]
    finally:
        serve.shutdown()
        ray.shutdown()


def test_smollm2_greedy_float32_through_the_link_equals_plain_decoding():
    target, drafter = str(SMOLLM), "smollm2-135m-instruct-moa"
    srv = Server(target, drafter, max_model_len=2048).install()
    uv = Uvicorn(create_app())
    try:
        plain = SpeculativeEngine.load(target, None, "float32")
        prompt = "Explain in a few sentences why the sky is blue."
        ref = plain.generate([prompt_tokens(plain.tokenizer, prompt, True)], 48)[0].token_ids
        outs = {}
        for codec in ("float16", "int8"):
            buf = io.StringIO()
            with contextlib.redirect_stdout(buf):
                assert (
                    main(
                        [
                            "client",
                            "generate",
                            "--server",
                            uv.url,
                            "--target",
                            target,
                            "--drafter",
                            drafter,
                            "--dtype",
                            "float32",
                            "--chat",
                            "--prompt",
                            prompt,
                            "--max-new-tokens",
                            "48",
                            "--fixed-k",
                            "-k",
                            "3",
                            "--feature-codec",
                            codec,
                            "--json",
                        ]
                    )
                    == 0
                )
            outs[codec] = json.loads(buf.getvalue())
        for out in outs.values():
            assert out["token_ids"] == ref and out["verified_tokens"] == len(ref) and out["offline_tokens"] == 0
            assert out["server_calls"] == out["rounds"] < len(ref)  # fewer calls than tokens
        # every verified position's feature travels down once whatever the codec: int8 saves about
        # half of each float16 feature (hidden bytes of 2 * hidden), and every round carries at
        # least one. int8's rounding may turn a draft (its rounds then differ from float16's, a few
        # headers apart): the saving is counted over the larger number of rounds
        hidden = read_config(SMOLLM).hidden_size
        saved = outs["float16"]["bytes_down"] - outs["int8"]["bytes_down"]
        assert saved >= 0.9 * hidden * max(out["rounds"] for out in outs.values())
        assert outs["int8"]["device_weights_mib"] < 200  # the target itself is 513 MiB in float32
    finally:
        uv.stop()
        from moa_serve.app import state

        state.install(cs=None, frontend=None)
        del srv
