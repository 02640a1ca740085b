"""build_app refuses configs that cannot work (fast: no Ray cluster, no weights loaded)."""

import copy
import json
from pathlib import Path

import pytest
import yaml

from moa_serve.deployments import fit
from moa_serve.deployments.app import KUBERAY_ENV, _options, build_app, check_placement, cluster_may_grow, validate
from moa_serve.deployments.config import (
    STREAM_DRAIN_S,
    AppConfig,
    ConfigError,
    Reservation,
    drain_warnings,
    placement_report,
    reservations,
    session_warnings,
)
from moa_serve.synthetic import SHAPES

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "deployments" / "configs"
GiB = 2**30

# Meta-Llama-3-8B-Instruct's config.json, the shape moa_serve/shapes ships
LLAMA3_8B = json.loads((SHAPES / "llama-3-8b-shape" / "config.json").read_text())


def args_of(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())["applications"][0]["args"]


@pytest.fixture
def llama3_dir(tmp_path, monkeypatch):
    d = tmp_path / "Meta-Llama-3-8B-Instruct"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
    monkeypatch.setenv("MOA_MODEL_DIR", str(tmp_path))
    return d


def small(**over) -> dict:
    """A stories260k config that fits, to break one thing at a time."""
    a = {
        "target": "stories260k",
        "drafter": None,
        "dtype": "float32",
        "router": {"max_sessions_per_round": 8, "session_groups": 2},
        "verifier_pool": {"max_sessions": 16, "autoscaling_config": {"max_replicas": 1}},
    }
    for k, v in over.items():
        a[k] = {**a.get(k, {}), **v} if isinstance(v, dict) else v
    return a


# --------------------------------------------------------------------------- sessions


def test_group_larger_than_a_replica_is_refused():
    with pytest.raises(ValueError, match=r"router.max_sessions_per_round \(32\) > verifier_pool.max_sessions \(16\)"):
        AppConfig.model_validate(small(router={"max_sessions_per_round": 32}))


def test_routers_admitting_more_than_the_pool_holds_is_refused():
    a = small(router={"max_sessions_per_round": 16, "session_groups": 2, "autoscaling_config": {"max_replicas": 2}})
    with pytest.raises(ValueError, match=r"may admit 64 sessions .* verifier_pool holds at most 16"):
        AppConfig.model_validate(a)
    a["verifier_pool"]["autoscaling_config"] = {"max_replicas": 4}
    AppConfig.model_validate(a)  # 4 x 16 = 64: fits


def test_drafter_pool_is_checked_too():
    a = small(drafter="some-drafter", drafter_pool={"max_sessions": 4})
    with pytest.raises(ValueError, match="drafter_pool.max_sessions"):
        AppConfig.model_validate(a)
    a["drafter"] = None  # no drafter, no drafter pool to check
    AppConfig.model_validate(a)


def test_pools_scale_on_sessions_not_calls():
    with pytest.raises(ValueError, match="target_sessions_per_replica"):
        AppConfig.model_validate(small(verifier_pool={"autoscaling_config": {"target_ongoing_requests": 4}}))
    cfg = AppConfig.model_validate(small(verifier_pool={"autoscaling_config": {"max_replicas": 1}}))
    opts = _options(cfg.verifier_pool)["autoscaling_config"]
    assert opts["policy"] == {
        "policy_function": "moa_serve.deployments.autoscaling:SessionsPolicy",
        "policy_kwargs": {"target_sessions_per_replica": 12.0},
    }  # 3/4 of 16
    assert "target_ongoing_requests" not in opts and "target_sessions_per_replica" not in opts
    assert "policy" not in _options(cfg.router)["autoscaling_config"]  # the Router keeps Ray's policy


def test_new_fields_and_dtype_auto():
    cfg = AppConfig.model_validate(small(dtype="auto"))
    assert cfg.verifier_pool.max_num_batched_tokens == 512 and cfg.router.speculation_token_budget == 32
    assert fit.dtype_bytes("auto", "cpu") == 4 and fit.dtype_bytes("auto", "cuda") == 2
    with pytest.raises(ValueError):
        AppConfig.model_validate(small(dtype="int8"))
    assert AppConfig.model_validate(cfg.model_dump()) == cfg  # what the replicas re-validate


def test_warnings_for_unreachable_replicas():
    cfg = AppConfig.model_validate(
        small(router={"session_groups": 1}, verifier_pool={"autoscaling_config": {"max_replicas": 3}})
    )
    assert any("never get work" in w for w in session_warnings(cfg))


# --------------------------------------------------------------------------- memory


def test_kv_arithmetic_llama3_8b():
    t = fit.ModelShape.from_hf(type("C", (), LLAMA3_8B))
    assert t.kv_bytes_per_token(2) == 128 * 1024  # 128 KiB per token in bf16
    assert 8.0e9 < t.params() < 8.1e9


def test_gpu_yaml_serves_the_torch_backend_on_whole_80gb_gpus(llama3_dir):
    cfg = AppConfig.model_validate(args_of("gpu.yaml"))
    assert (cfg.backend, cfg.device, cfg.load_format) == ("torch", "cuda", "auto")
    assert cfg.verifier_pool.ray_actor_options.num_gpus == 1  # whole GPUs
    results = validate(cfg)
    v = next(f for f in results if f.pool == "verifier_pool")
    assert v.ok and v.capacity == int(0.9 * 80 * GiB)
    assert 48 * GiB < v.kv < 48.01 * GiB  # 48 preallocated full 8,192-token contexts
    assert v.activations > 0  # the logits of a chunk and the CUDA graphs' pool
    d = next(f for f in results if f.pool == "drafter_pool")
    assert d.ok and d.capacity == int(0.9 * 80 * GiB * 0.25)


def test_gpu_1x_yaml_shares_one_gpu_between_a_verifier_and_a_drafter():
    cfg = AppConfig.model_validate(args_of("gpu-1x.yaml"))
    assert (cfg.backend, cfg.device) == ("torch", "cuda")
    pools = cfg.pools()
    assert set(pools) == {"verifier_pool", "drafter_pool"}
    assert all(p.autoscaling_config.max_replicas == 1 for p in pools.values())
    assert sum(p.ray_actor_options.num_gpus for p in pools.values()) == 1.0
    assert all(0 < p.ray_actor_options.num_gpus < 1 for p in pools.values())
    assert all(f.ok for f in validate(cfg))
    check_placement(cfg, [{"CPU": 16.0, "GPU": 1.0}])  # one box, one GPU


def test_gpu_vllm_yaml_says_it_has_not_run_on_a_gpu_and_fits_an_80gb_gpu(llama3_dir):
    assert (CONFIGS / "gpu-vllm.yaml").read_text().startswith("# NOT YET RUN ON A GPU")
    cfg = AppConfig.model_validate(args_of("gpu-vllm.yaml"))
    assert cfg.backend == "vllm"
    results = validate(cfg)
    v = next(f for f in results if f.pool == "verifier_pool")
    assert v.ok and v.capacity == int(0.9 * 80 * GiB)
    assert v.kv == 48 * GiB and 14.9 * GiB < v.weights < 15.0 * GiB  # vLLM's paged cache: kv_cache_gib
    assert v.total < 64.5 * GiB  # the feature buffers of the compiled forward included
    d = next(f for f in results if f.pool == "drafter_pool")
    assert d.ok and d.capacity == int(0.9 * 80 * GiB * 0.25) and d.total < 9 * GiB


def test_gpu_yaml_arithmetic_refuses_what_does_not_fit(llama3_dir):
    a = args_of("gpu-vllm.yaml")
    a["verifier_pool"]["kv_cache_gib"] = 60
    with pytest.raises(ValueError, match=r"verifier_pool: weights 14.96 GiB \+ KV cache 60.00 GiB .* > 72.00 GiB"):
        build_app(a)
    # the torch backend preallocates max_sessions full contexts: 96 x 1 GiB
    a = args_of("gpu-vllm.yaml")
    a["backend"] = "torch"
    del a["verifier_pool"]["kv_cache_gib"]
    with pytest.raises(ValueError, match=r"verifier_pool: weights 14.96 GiB \+ KV cache 96.01 GiB .* > 72.00 GiB"):
        build_app(a)


def test_vllm_backend_rules(llama3_dir):
    a = args_of("gpu-vllm.yaml")
    with pytest.raises(ValueError, match="hybrid drafter needs backend torch"):
        AppConfig.model_validate({**a, "drafter": "hybrid:" + a["drafter"]})
    with pytest.raises(ValueError, match=r"drafter_pool.max_sessions \(8\) < verifier_pool.max_sessions \(96\)"):
        AppConfig.model_validate({**a, "drafter_pool": {**a["drafter_pool"], "max_sessions": 8}})
    a["verifier_pool"]["kv_cache_gib"] = 0.5  # less than one 8,192-token request (1 GiB)
    with pytest.raises(ValueError, match="holds less than one request"):
        validate(AppConfig.model_validate(a))
    with pytest.raises(ValueError, match="matmul_precision 'medium' is a torch-backend setting"):
        AppConfig.model_validate({**args_of("gpu-vllm.yaml"), "matmul_precision": "medium"})
    with pytest.raises(ValueError, match="matmul_precision 'low' is a torch-backend setting"):
        AppConfig.model_validate({**args_of("gpu-vllm.yaml"), "matmul_precision": "low"})
    with pytest.raises(ValueError, match="matmul_precision"):
        AppConfig.model_validate({**args_of("gpu-vllm.yaml"), "matmul_precision": "lowest"})
    with pytest.raises(ValueError, match="kv_cache_dtype 'bfloat16' is a torch-backend setting"):
        AppConfig.model_validate({**args_of("gpu-vllm.yaml"), "kv_cache_dtype": "bfloat16"})
    lookup = AppConfig.model_validate({**args_of("gpu-vllm.yaml"), "drafter": "lookup"})  # vLLM's n-gram: no pool
    assert set(lookup.pools()) == {"verifier_pool"}
    with pytest.raises(ValueError, match=r"drafter 'lookup\+outputs': the output store is looked up in the Router"):
        AppConfig.model_validate({**args_of("gpu-vllm.yaml"), "drafter": "lookup+outputs"})
    with pytest.raises(ValueError, match="tree drafts need backend torch"):
        AppConfig.model_validate({**args_of("gpu-vllm.yaml"), "branching": "4-2"})
    with pytest.raises(ValueError, match="static_forward and batch_invariant are torch-backend settings"):
        AppConfig.model_validate({**args_of("gpu-vllm.yaml"), "batch_invariant": "off"})


def test_branching_is_a_tree_shape():
    a = args_of("local-cpu.yaml")
    assert AppConfig.model_validate({**a, "branching": "4-2"}).branching == "4-2"
    with pytest.raises(ValueError, match="branching: branching widths must be between 1 and 16"):
        AppConfig.model_validate({**a, "branching": "4-40"})


def test_cpu_memory_option_is_the_limit(stories_path, monkeypatch):
    monkeypatch.setenv("MOA_MODEL_DIR", str(stories_path.parent))
    cfg = AppConfig.model_validate(small(verifier_pool={"ray_actor_options": {"memory": 4 * 2**20}}))
    with pytest.raises(ValueError, match=r"ray_actor_options.memory"):
        validate(cfg)
    cfg = AppConfig.model_validate(small())
    (v,) = validate(cfg)
    assert v.ok and v.capacity_of == "0.9 x host RAM"


def test_cuda_without_gpus_is_refused(llama3_dir):
    a = args_of("gpu.yaml")
    a["verifier_pool"]["ray_actor_options"]["num_gpus"] = 0
    with pytest.raises(ValueError, match="num_gpus is 0"):
        validate(AppConfig.model_validate(a))


@pytest.mark.parametrize("name", ["local-cpu.yaml", "local-cpu-2x.yaml", "local-cpu-vllm.yaml"])
def test_local_configs_are_valid(name):  # MOA_MODEL_DIR: ../shared/models (conftest)
    cfg = AppConfig.model_validate(args_of(name))
    assert cfg.dtype == "auto"
    results = validate(cfg)
    assert all(f.ok for f in results)
    if name == "local-cpu.yaml":  # prompt lookup in the Router: no drafter pool
        assert cfg.drafter == "lookup+outputs" and cfg.drafter_checkpoint is None and cfg.prompt_lookup
        assert {f.pool for f in results} == {"verifier_pool"} and set(cfg.pools()) == {"verifier_pool"}
        assert cfg.router.session_groups == 1 and cfg.router.max_sessions_per_round == 64
        # slots beyond the live sessions keep finished prompts' K/V (the prefix cache)
        assert cfg.verifier_pool.max_sessions == 128 and cfg.verifier_pool.torch_threads == 2
    elif name == "local-cpu-vllm.yaml":
        assert cfg.backend == "vllm" and cfg.drafter_checkpoint is not None
        v = next(f for f in results if f.pool == "verifier_pool")
        assert v.kv == fit.full_kv_bytes(cfg, fit.target_shape(cfg))  # no kv_cache_gib: full contexts
    else:
        assert {f.pool for f in results} == {"verifier_pool", "drafter_pool"}
        assert cfg.verifier_pool.autoscaling_config.min_replicas == 2
        assert cfg.drafter_pool.autoscaling_config.min_replicas == 2 and cfg.router.session_groups >= 2


def test_drafter_shape_from_a_packaged_checkpoint():
    cfg = AppConfig.model_validate(args_of("local-cpu-2x.yaml"))
    t = fit.target_shape(cfg)
    d = fit.drafter_shape(cfg.drafter, t)
    assert (
        d.kind == "moa" and not d.estimated and d.draft_vocab == 2048
    )  # the shipped draft vocabulary (moa drafter shrink-vocab)
    assert d.kv_width_per_token == 2 * 3 * 64  # SA + CA, 3 KV heads x 64 each
    est = fit.drafter_shape("nobody/not-here", t)
    assert est.estimated and est.kv_width_per_token == 2 * t.kv_width


def test_unchanged_input_not_mutated():
    a = small()
    before = copy.deepcopy(a)
    AppConfig.model_validate(a)
    assert a == before


def test_prompt_lookup_specs_size_the_drafter_pool():
    cfg = AppConfig.model_validate(args_of("local-cpu-2x.yaml"))
    t = fit.target_shape(cfg)
    assert fit.drafter_shape("lookup", t).kind == "lookup"
    h = fit.drafter_shape("hybrid:smollm2-135m-instruct-moa", t)
    assert h.kind == "moa" and not h.estimated and h.draft_vocab == 2048
    hybrid = AppConfig.model_validate({**args_of("local-cpu-2x.yaml"), "drafter": "hybrid:smollm2-135m-instruct-moa"})
    assert hybrid.drafter_checkpoint == "smollm2-135m-instruct-moa" and hybrid.prompt_lookup
    assert {f.pool for f in validate(hybrid)} == {"verifier_pool", "drafter_pool"}
    # the target's earlier replies beside prompt lookup: still the Router's lookup, the same pools
    store = AppConfig.model_validate({**args_of("local-cpu-2x.yaml"), "drafter": "lookup+outputs"})
    assert store.prompt_lookup and store.drafter_checkpoint is None and set(store.pools()) == {"verifier_pool"}
    both = AppConfig.model_validate(
        {**args_of("local-cpu-2x.yaml"), "drafter": "hybrid+outputs:smollm2-135m-instruct-moa"}
    )
    assert both.drafter_checkpoint == "smollm2-135m-instruct-moa" and both.prompt_lookup


def test_a_bf16_kv_cache_halves_the_verifiers_kv_in_the_memory_fit():
    """kv_cache_dtype bfloat16 under a float32 (dtype auto on a CPU) target: the fit counts 2 bytes
    per KV element instead of 4; an unknown dtype is refused by name."""
    a = args_of("local-cpu.yaml")
    f32, bf16 = (AppConfig.model_validate({**a, "kv_cache_dtype": d}) for d in ("auto", "bfloat16"))
    shape = fit.target_shape(f32)
    assert fit.full_kv_bytes(bf16, shape) * 2 == fit.full_kv_bytes(f32, shape)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        AppConfig.model_validate({**a, "kv_cache_dtype": "fp8"})


def test_client_drafter_serves_devices_beside_a_lookup_router():
    """``client_drafter``: the checkpoint whose features devices read; with drafter lookup the
    verifier runs its feature head (for device sessions) and no drafter pool is deployed."""
    cfg = AppConfig.model_validate(args_of("local-cpu.yaml"))
    assert cfg.drafter == "lookup+outputs" and cfg.client_drafter == "smollm2-135m-instruct-moa"
    assert cfg.feature_drafter == "smollm2-135m-instruct-moa" and set(cfg.pools()) == {"verifier_pool"}
    served = AppConfig.model_validate({**args_of("local-cpu-2x.yaml")})
    assert served.client_drafter is None and served.feature_drafter == served.drafter_checkpoint
    same = AppConfig.model_validate(
        {
            **args_of("local-cpu-2x.yaml"),
            "drafter": "hybrid:smollm2-135m-instruct-moa",
            "client_drafter": "smollm2-135m-instruct-moa",
        }
    )
    assert same.feature_drafter == "smollm2-135m-instruct-moa"
    with pytest.raises(ValueError, match="client_drafter 'smollm2-135m-instruct-eagle' is not the served drafter"):
        AppConfig.model_validate({**args_of("local-cpu-2x.yaml"), "client_drafter": "smollm2-135m-instruct-eagle"})
    with pytest.raises(ValueError, match="client_drafter 'hybrid:smollm2-135m-instruct-moa': name the trained"):
        AppConfig.model_validate({**args_of("local-cpu.yaml"), "client_drafter": "hybrid:smollm2-135m-instruct-moa"})
    with pytest.raises(ValueError, match="client_drafter: client-server mode needs backend torch"):
        AppConfig.model_validate(
            {**args_of("local-cpu-vllm.yaml"), "drafter": None, "client_drafter": "smollm2-135m-instruct-moa"}
        )


def test_a_router_in_the_gateway_admits_sessions_per_gateway_replica():
    # one Router per Gateway replica: the Gateway's range counts, the Router replica range is unused
    a = small(
        router={
            "in_gateway": True,
            "max_sessions_per_round": 8,
            "session_groups": 2,
            "autoscaling_config": {"min_replicas": 8, "max_replicas": 8},
        }
    )
    assert AppConfig.model_validate(a).router_replicas.max_replicas == 1
    a["gateway"] = {"autoscaling_config": {"max_replicas": 2}}
    with pytest.raises(ValueError, match=r"may admit 32 sessions \(gateway max_replicas 2 x session_groups 2"):
        AppConfig.model_validate(a)


# --------------------------------------------------------------------------- placement on the cluster
TWO_CORES = [{"CPU": 2.0, "GPU": 0.0}]  # one 2-core machine, as `serve run` starts Ray on it


@pytest.mark.parametrize("name", ["local-cpu.yaml", "local-cpu-2x.yaml", "local-cpu-vllm.yaml"])
def test_every_one_machine_config_is_placed_on_two_cores(name):
    problems, _ = placement_report(reservations(AppConfig.model_validate(args_of(name))), TWO_CORES)
    assert problems == []


def test_reservations_name_every_deployment_with_its_replicas():
    cfg = AppConfig.model_validate(args_of("local-cpu-2x.yaml"))
    assert {(r.deployment, r.start, r.cpus) for r in reservations(cfg)} == {
        ("Gateway", 1, 0.0),
        ("Router", 1, 0.0),
        ("VerifierPool", 2, 0.5),
        ("DrafterPool", 2, 0.5),
    }
    # the Router inside the Gateway has no replicas; prompt lookup needs no drafter pool
    assert [r.deployment for r in reservations(AppConfig.model_validate(args_of("local-cpu.yaml")))] == [
        "Gateway",
        "VerifierPool",
    ]
    assert "VllmVerifier" in {
        r.deployment for r in reservations(AppConfig.model_validate(args_of("local-cpu-vllm.yaml")))
    }
    # a deployment that scales from zero still needs room for its first replica
    zero = AppConfig.model_validate(small(verifier_pool={"autoscaling_config": {"min_replicas": 0, "max_replicas": 1}}))
    assert next(r for r in reservations(zero) if r.deployment == "VerifierPool").start == 1


def test_a_gateway_left_without_a_core_is_refused_with_the_arithmetic():
    a = args_of("local-cpu-2x.yaml")
    a["gateway"] = {"ray_actor_options": {"num_cpus": 0.25}}  # all 2 cores already go to the pools
    cfg = AppConfig.model_validate(a)
    problems, _ = placement_report(reservations(cfg), TWO_CORES)
    assert problems == [
        "the replicas at start reserve 2.25 CPUs (Gateway 1 x 0.25 + VerifierPool 2 x 0.5 + DrafterPool 2 x 0.5) "
        "but the cluster has 2: Gateway would wait to be scheduled forever; lower ray_actor_options.num_cpus (a "
        "deployment that computes little, such as the Gateway, may reserve 0) or start fewer replicas"
    ]
    with pytest.raises(ConfigError, match=r"(?s)cannot be placed .* reserve 2.25 CPUs .* the cluster has 2: Gateway"):
        check_placement(cfg, TWO_CORES)
    check_placement(cfg, None)  # outside a Ray cluster there is nothing to check against
    # on a cluster that grows (KubeRay), the same is a warning naming who waits
    problems, warnings = placement_report(reservations(cfg), TWO_CORES, may_grow=True)
    assert (
        problems == []
        and len(warnings) == 1
        and "Gateway would wait to be scheduled until the cluster adds" in warnings[0]
    )


def test_gpus_and_nodes_are_counted_too():
    gpu = [Reservation("VerifierPool", 1, 8, 4, 1.0), Reservation("DrafterPool", 1, 8, 2, 0.25)]
    problems, _ = placement_report(gpu, [{"CPU": 16, "GPU": 1}])
    assert (
        len(problems) == 1
        and "reserve 1.25 GPUs (VerifierPool 1 x 1 + DrafterPool 1 x 0.25) but the cluster has 1: "
        "DrafterPool would wait"
        in problems[0]
    )
    # the totals fit two 1-GPU nodes; growing to 8 + 8 replicas would not: a warning naming both
    problems, warnings = placement_report(gpu, [{"CPU": 16, "GPU": 1}] * 2)
    assert problems == [] and any(
        "at max_replicas the replicas reserve 10 GPUs" in w and "new VerifierPool, DrafterPool replicas wait" in w
        for w in warnings
    )
    # 3 CPUs in all, but no node holds a 1.5-CPU replica
    big = [Reservation("VerifierPool", 1, 1, 1.5, 0.0)]
    problems, _ = placement_report(big, [{"CPU": 1}, {"CPU": 2}])
    assert problems == []
    problems, _ = placement_report(big, [{"CPU": 1}, {"CPU": 1}, {"CPU": 1}])
    assert problems == [
        "the replicas at start fit the cluster's totals but not its nodes (1 CPU / 0 GPU, 1 CPU / 0 "
        "GPU, 1 CPU / 0 GPU): VerifierPool would wait to be scheduled"
    ]


def test_the_kuberay_head_alone_warns_instead_of_refusing(llama3_dir, monkeypatch):
    """gpu.yaml on KubeRay: at build time the cluster may be the CPU-less head alone; its
    autoscaler adds the worker Pods the waiting replicas ask for."""
    for k in KUBERAY_ENV:
        monkeypatch.delenv(k, raising=False)
    assert not cluster_may_grow()
    monkeypatch.setenv("KUBERAY_GEN_RAY_START_CMD", "ray start --head --num-cpus=0")  # what KubeRay's Pods carry
    assert cluster_may_grow()
    cfg = AppConfig.model_validate(args_of("gpu.yaml"))
    head = [{"CPU": 0.0, "GPU": 0.0}]
    problems, warnings = placement_report(reservations(cfg), head, may_grow=True)
    assert problems == [] and len(warnings) == 2  # CPUs and GPUs
    assert (
        "reserve 18 CPUs (Gateway 1 x 2 + Router 5 x 2 + VerifierPool 1 x 4 + DrafterPool 1 x 2) but the "
        "cluster has 0: VerifierPool, Gateway, Router, DrafterPool would wait to be scheduled until the cluster "
        "adds nodes"
    ) in warnings[0]
    with pytest.raises(ConfigError, match="reserve 18 CPUs"):  # the same cluster that cannot grow
        check_placement(cfg, head, may_grow=False)


def test_replicas_that_hold_streams_drain_them_before_an_update_replaces_them():
    cfg = AppConfig.model_validate(small())
    assert _options(cfg.gateway)["graceful_shutdown_timeout_s"] == STREAM_DRAIN_S
    # a Router's sessions resume on another Router; a pool replica holds calls of one round each
    assert _options(cfg.router)["graceful_shutdown_timeout_s"] < STREAM_DRAIN_S
    assert _options(cfg.verifier_pool)["graceful_shutdown_timeout_s"] < STREAM_DRAIN_S
    cfg = AppConfig.model_validate(small(gateway={"graceful_shutdown_timeout_s": 90}))
    assert _options(cfg.gateway)["graceful_shutdown_timeout_s"] == 90


def test_haproxy_that_cuts_streams_before_the_drain_is_warned_about():
    cfg = AppConfig.model_validate(small())
    assert drain_warnings(cfg, {}) == []  # Serve's Python proxy: no hard stop
    haproxy = {"RAY_SERVE_ENABLE_HA_PROXY": "1"}
    [w] = drain_warnings(cfg, haproxy)  # Ray's default hard stop, 120 s
    assert "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S=120" in w and f"{STREAM_DRAIN_S:g}" in w
    assert drain_warnings(cfg, {**haproxy, "RAY_SERVE_HAPROXY_HARD_STOP_AFTER_S": str(int(STREAM_DRAIN_S))}) == []
