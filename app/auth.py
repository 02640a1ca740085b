"""API keys of the HTTP API: where they come from (``HttpAuthConfig``, a key file, an environment
variable) and how a presented key is checked (``KeyRing``). The middleware that asks for them is
``app/access.py``; what is protected and how to rotate keys: docs/security.md.

A key is a shared secret: any holder may call every ``/v1`` route. Keys are kept as SHA-256
digests and a presented key is compared with every one of them in constant time
(``hmac.compare_digest``), so neither the time of an answer nor a log line tells anything about
a key. A key file is re-read when it changes (a Kubernetes Secret volume is updated in place), so
keys rotate without a restart; a file that becomes unreadable or empty keeps the keys it held
(the API never opens up on its own)."""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time

from pydantic import BaseModel, ConfigDict, Field, SecretStr

log = logging.getLogger(__name__)

KEYS_ENV = "MOA_API_KEYS"  # comma- or whitespace-separated keys
API_KEY_ENV = "MOA_API_KEY"  # the key the project's clients send (moa client, moa loadtest) when none is given
KEYS_FILE_ENV = "MOA_API_KEYS_FILE"  # a key file, when http_auth.api_keys_file is not set
RELOAD_CHECK_S = 2.0  # how often the key file's identity (inode, size, mtime) is looked at


def client_headers() -> dict[str, str]:
    """``Authorization: Bearer $MOA_API_KEY`` when that variable is set (what the project's load
    tools send to a server with API keys), else nothing."""
    key = os.environ.get(API_KEY_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


class HttpAuthConfig(BaseModel):
    """API keys (docs/security.md). The keys are those of `api_keys`, of the file `api_keys_file`
    (default: the file named by $MOA_API_KEYS_FILE) and of $MOA_API_KEYS (comma-separated), all
    together. With at least one key every /v1 route needs `Authorization: Bearer <key>` (401
    otherwise); /healthz and /readyz stay open. With none the API is open, and each Gateway
    replica says so in one warning at start."""

    model_config = ConfigDict(extra="forbid")

    api_keys: list[SecretStr] = Field(
        [],
        description="keys written in the config itself: for a local test only (a serve config is shown by the Ray "
        "dashboard and `serve status`); use the key file or $MOA_API_KEYS, on Kubernetes a Secret",
    )
    api_keys_file: str | None = Field(
        None,
        description="a file of keys, one per line (blank lines and lines starting with # are skipped); default: "
        "$MOA_API_KEYS_FILE. A file that is named must hold a key, or the Gateway does not start. It is re-read when "
        "it changes: keys rotate without a restart",
    )


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def parse_keys(text: str) -> list[str]:
    """The keys of a key file (one per line) or of $MOA_API_KEYS (commas or whitespace between keys)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        out += [k for k in line.replace(",", " ").split() if k]
    return out


def bearer(header: bytes | None) -> str | None:
    """The credentials of an ``Authorization: Bearer <key>`` header (None when absent or another scheme)."""
    if not header:
        return None
    try:
        scheme, _, value = header.decode("latin-1").strip().partition(" ")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        return None
    if scheme.lower() != "bearer":
        return None
    value = value.strip()
    return value or None


class KeyRing:
    """The configured keys, as digests. ``match(key)`` answers the key's identity (its digest, for
    the per-key limits; never the key) or None. Empty: the API is open."""

    def __init__(self, keys: list[str] = (), file: str | None = None):
        self._fixed = {digest(k) for k in keys if k}
        self.file = file
        self._file_keys: set[bytes] = set()
        self._file_id: tuple | None = None
        self._checked = 0.0
        if file is not None:
            self._load_file(first=True)
        self._all = frozenset(self._fixed | self._file_keys)

    @classmethod
    def from_config(cls, cfg: HttpAuthConfig | None, environ: dict | None = None) -> "KeyRing":
        env = os.environ if environ is None else environ
        cfg = cfg or HttpAuthConfig()
        keys = [k.get_secret_value() for k in cfg.api_keys] + parse_keys(env.get(KEYS_ENV, ""))
        return cls(keys, cfg.api_keys_file or env.get(KEYS_FILE_ENV) or None)

    def __repr__(self) -> str:  # never the keys
        return f"KeyRing({len(self._all)} keys{', file ' + self.file if self.file else ''})"

    def __len__(self) -> int:
        self._maybe_reload()
        return len(self._all)

    @property
    def enabled(self) -> bool:
        return len(self) > 0

    def _load_file(self, first: bool = False) -> None:
        try:
            st = os.stat(self.file)
            ident = (st.st_ino, st.st_size, st.st_mtime_ns)
            if ident == self._file_id:
                return
            with open(self.file, encoding="utf-8") as f:
                keys = parse_keys(f.read())
        except (OSError, UnicodeDecodeError) as exc:
            if first:
                raise ValueError(
                    f"http_auth: the key file {self.file} cannot be read: {type(exc).__name__}: "
                    f"{exc.strerror if isinstance(exc, OSError) else exc}"
                ) from None
            log.warning(
                "http_auth: the key file %s cannot be read (%s); the keys it held stay valid",
                self.file,
                type(exc).__name__,
            )
            return
        if not keys:
            if first:
                raise ValueError(f"http_auth: the key file {self.file} holds no key (one per line)")
            log.warning("http_auth: the key file %s holds no key now; the keys it held stay valid", self.file)
            self._file_id = ident
            return
        if not first:
            log.warning("http_auth: the key file %s changed: %d keys", self.file, len(keys))
        self._file_keys = {digest(k) for k in keys}
        self._file_id = ident

    def _maybe_reload(self) -> None:
        if self.file is None:
            return
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return
        self._checked = now
        self._load_file()
        self._all = frozenset(self._fixed | self._file_keys)

    def match(self, key: str | None) -> bytes | None:
        """The digest of ``key`` when it is one of the keys (compared with each in constant time), else None."""
        self._maybe_reload()
        if key is None:
            return None
        d = digest(key)
        found = False
        for known in self._all:  # no early exit: the time does not depend on which key matched
            found |= hmac.compare_digest(d, known)
        return d if found else None
