"""The vocabulary every layer shares: records, errors, problems, keys, fingerprints, options.

Nothing here touches a database or a request; :mod:`flask_idem.store` and everything above
import it.
"""

#: The release (also the version of :mod:`flask_idem.ops.otel`'s instrumentation scope).
__version__ = "0.1.0"
