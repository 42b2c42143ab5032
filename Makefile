# The two set-up commands in README.md are `make demo` and `make test`; each installs what it
# needs into .venv first. CI (.ci/run) calls `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-dev

.PHONY: demo test lint bench clean down devtools-trace

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch stays an optional extra; the dev set-up pins the local CPU build explicitly.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $@

demo: $(STAMP)
	$(VENV)/bin/perfloop demo
	$(VENV)/bin/perfloop demo --real

# The unit, property and doctests share nothing: two processes run them. Then the integration
# tests, against the real embedded stack, one at a time (they time what the stack does).
test: $(STAMP) devtools-trace
	$(PY) -m pytest -m "not integration" -n 2; unit=$$?; \
	$(PY) -m pytest -m integration; integration=$$?; \
	exit $$(( unit || integration ))

# Chrome DevTools' trace engine, which the tests use to read the traces `perfloop export`
# writes (pinned in its package-lock.json); where npm is missing or fails, those tests skip.
devtools-trace:
	@if command -v npm >/dev/null 2>&1; then \
		cd tests/tools/devtools_trace && timeout 300 npm ci --silent --no-audit --no-fund \
			|| echo "devtools-trace: npm ci failed; the tests that need it skip"; \
	else echo "devtools-trace: no npm here; the tests that read traces with it skip"; fi

lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .
	# mypy cannot follow the editable install's folder mapping: check an installed copy.
	rm -rf build/typecheck
	$(PY) -m pip install -q --no-deps --no-build-isolation --target build/typecheck .
	cd build/typecheck && ../../$(VENV)/bin/mypy --config-file ../../pyproject.toml \
		-p perfloop.schemas -p perfloop.models

bench: $(STAMP)
	$(PY) bench/e2e.py

down:
	$(VENV)/bin/perfloop down

clean:
	rm -rf $(VENV) .perfloop build *.egg-info tests/tools/devtools_trace/node_modules
