"""Serving: requests and their states, the scheduler, sampling, the anyio engine, and the runner that builds an
engine over the reference model (:func:`~kvferry.engine.runner.build_engine`)."""
