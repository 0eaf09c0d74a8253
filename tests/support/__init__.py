"""Factories, fakes and peer programs the test suites share.

The peer programs (``transport_peer.py``, ``hostile.py``, ``ucx_peer_death.py``, ``generation_peer.py``) also run
as scripts of their own process: ``python tests/support/NAME.py``; :data:`SUPPORT` is where they are.
"""

from pathlib import Path

#: this directory, for starting its peer programs as scripts
SUPPORT = Path(__file__).resolve().parent
