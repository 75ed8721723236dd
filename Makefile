# The two commands of the README's quick start. Each installs whatever is missing first
# (scripts/setup_env.sh is idempotent), then runs.
VENV ?= .venv
LATEST_TESTS ?= tests/parallel/test_tf_collectives.py tests/tf/test_strategy.py tests/parallel/test_launch.py tests/tf/test_resume.py
# extra pytest arguments of make test / test-latest: CI gives --durations=30 (the slowest tests)
PYTEST_ARGS ?=
export PARALLAX_VENV := $(abspath $(VENV))

.PHONY: demo test test-fast test-latest env env-latest bench compare wheel-check image

demo: env          ## install everything, then run the main job
	$(VENV)/bin/parallax demo

test: env          ## install everything, then run the whole test suite (every tier, each within its time budget)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

test-fast: env     ## the unit tier alone (tests/unit): no TensorFlow, no process (seconds; tests/tiers.py)
	$(VENV)/bin/python -m pytest tests/unit

env:
	bash scripts/setup_env.sh

env-latest:        ## the second environment: the newest TensorFlow, no Horovod (.venv-latest)
	bash scripts/setup_env_latest.sh

test-latest: env-latest  ## the strategy, launcher, resume and TF-collectives tests on the newest TensorFlow
	.venv-latest/bin/python -m pytest -m "not horovod" $(PYTEST_ARGS) $(LATEST_TESTS)

wheel-check:       ## build the wheel, install it with [tf] in a fresh venv, train the quick start
	bash scripts/check_wheel.sh

bench: env         ## parameter-server throughput benchmark (prints a table, writes JSON)
	$(VENV)/bin/python examples/benchmarks/ps_throughput.py

compare: env       ## parallax vs TF PS and Horovod: equal hardware at 2, 4, 8 workers first, then dedicated servers, the paper's link ratio, one worker, dense, shared cores (root; ~3 h)
	bash scripts/compare.sh bench-results/compare

image:             ## container image: podman build (local debootstrap base) + smoke test (root; 5-10 min cold)
	bash scripts/build_image.sh
