"""Drop-in shims for code written against other EP libraries: `pyep.compat.deep_ep.Buffer` (DeepEP's
low-latency API) and `pyep.compat.mooncake.Buffer` (Mooncake EP's API)."""
