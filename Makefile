# The two commands of the README (demo, test) set up what they need first (hack/setup), from the
# lock: the demo its runtime part (requirements/runtime.txt), the tests the whole lock
# (requirements/lock.txt). unit, e2e and lint are the tiers of `make test`, for a quicker loop.
.PHONY: demo test unit e2e lint docs lock

PYTEST := .venv/bin/python -m pytest -ra --durations=25
# hack/'s Python scripts have no .py suffix: ruff is handed them by name (hack/lib by folder).
HACK_PY := $(shell grep -l '^\#!.*python' hack/* 2>/dev/null)

demo:
	hack/setup run
	@echo "make demo: training two workers on Fashion-MNIST (examples/fashion-mnist-2workers.yaml)…" >&2
	.venv/bin/ringtrain run examples/fashion-mnist-2workers.yaml

test:
	hack/setup test
	$(MAKE) --no-print-directory lint
	$(PYTEST) $(PYTEST_ARGS)

unit:
	hack/setup test
	$(PYTEST) -m "not e2e and not slow" $(PYTEST_ARGS)

e2e:
	hack/setup test
	$(PYTEST) -m e2e $(PYTEST_ARGS)

lint:
	.venv/bin/ruff check operator trainer tests hack/lib $(HACK_PY)
	.venv/bin/ruff format --check operator trainer tests hack/lib $(HACK_PY)
	.venv/bin/lint-imports --no-cache
	.venv/bin/mypy
	$(MAKE) --no-print-directory docs

# The documentation site (mkdocs.yml, docs/): strict, so a broken link, a missing anchor or a page
# left out of the nav fails the build. Generated pages (docs/reference.md, docs/layers.md) have
# their own staleness tests. Open .site/index.html, or `.venv/bin/mkdocs serve`.
docs:
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir .site

# Move every pin to the newest release pyproject allows; review `git diff requirements/`.
lock:
	hack/lock-requirements --upgrade
