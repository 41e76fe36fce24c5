"""The vLLM engine, below the steps: its settings (config.py: EngineOptions, the host's GPU count), the one
device check (devices.py) and the one lifecycle (lifecycle.py: start, signals, start timeout, close, log lines).
The capture (remote.capture.backend_vllm), regenerate (remote.data.regenerate_engines) and online evaluation
(remote.evaluate.online_measure) start their engines through it."""
