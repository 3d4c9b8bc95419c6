"""``make bench``: what idempotency costs per request, measured against the same endpoint bare.

One run starts a durable throwaway PostgreSQL (or uses ``DATABASE_URL``), serves two apps
under gunicorn on loopback (:mod:`bench.apps`), drives them in interleaved rounds with the
same load (:mod:`bench.load`) and reads the SQL each request cost from the server itself
(:mod:`bench.db`). ``python -m bench growth`` shows the claim staying flat as the table grows
(:mod:`bench.growth`).
"""

from __future__ import annotations
