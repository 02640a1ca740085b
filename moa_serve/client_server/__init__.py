"""Client-server mode (the paper's second deployment): the drafter runs on the user's device,
the target verifies on the cluster. ``wire`` is the binary framing both sides speak,
``fingerprint`` what the handshake compares, ``sessions`` the server's session table over the
RoundService; the device side is ``moa_serve.client``."""
