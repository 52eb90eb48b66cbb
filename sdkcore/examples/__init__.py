"""Worked examples of an SDK built on sdkcore, tested like the product (see rfc/0007).

* :mod:`sdkcore.examples.memcached`: a memcached binary-protocol client whose
  dispatch goes through the orchestrator, a circuit breaker per endpoint with a
  NOOP canary, and the KV mapper.
"""
