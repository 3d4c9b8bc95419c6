"""Operations: reconciliation, the downstream check, ``flask idem``, metrics and tracing."""
