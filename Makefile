# The two commands of the README. Both set up what they need first (hack/setup).
.PHONY: demo test unit lint

demo:
	hack/setup run
	.venv/bin/ringtrain run examples/fashion-mnist-2workers.yaml

test:
	hack/setup test
	.venv/bin/python -m pytest -ra $(PYTEST_ARGS)

unit:
	hack/setup test
	.venv/bin/python -m pytest -ra -m "not e2e" $(PYTEST_ARGS)
