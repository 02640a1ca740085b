"""Numbers a sampler cannot run as a client writes them in the JSON text (Python's json, as
FastAPI's, reads NaN and Infinity, and a number too large for a double as an infinity)."""

from __future__ import annotations

NOT_FINITE_OR_EXTREME = {
    "nan": "NaN",
    "inf": "Infinity",
    "-inf": "-Infinity",
    "overflow": "1e400",
    "huge": "1.7976931348623157e308",
    "-denormal": "-5e-324",
}
