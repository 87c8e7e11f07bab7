# Two commands a fresh machine needs: `make demo` and `make test`. Everything else is a helper.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck check bench clean host-tools native

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev]'
	@# The editable install's finder (setuptools writes one for our two package roots, . and cli/) imports
	@# pathlib at every start of this venv's Python, 25-35 ms on 2 slow cores, more than `gpusched submit`
	@# needs in all: the same two roots as plain path lines cost nothing (an installed wheel has neither).
	$(BIN)/python -c 'import glob, sys, sysconfig; \
		[open(p, "w").write(sys.argv[1] + "\n" + sys.argv[1] + "/cli\n") \
		 for p in glob.glob(sysconfig.get_paths()["purelib"] + "/__editable__.gpusched-*.pth")]' "$(CURDIR)"
	touch $(STAMP)

## The scheduling core compiled with mypyc (gpusched/native.py): about twice as fast a pass, rebuilt when a core
## source changes. Optional: without a C compiler the core runs as the pure Python it is compiled from.
NATIVE := gpusched/core/_native/sources.json
$(NATIVE): $(STAMP) $(wildcard gpusched/core/*.py)
	@echo "compiling the scheduling core with mypyc (log: $(VENV)/native-build.log)"
	@$(BIN)/python -m gpusched.native build > $(VENV)/native-build.log 2>&1 \
		&& tail -n 1 $(VENV)/native-build.log \
		|| { tail -n 3 $(VENV)/native-build.log; \
		     echo "note: the scheduling core runs as pure Python (the same decisions, slower passes)"; }

## The job's child in C (gpusched/daemon/execjob.c), which the shim starts with posix_spawn: ~3 ms off every
## job's start. Optional too: without a C compiler the shim forks a Python child (the same job, slower).
EXECJOB := gpusched/daemon/_execjob/.built
$(EXECJOB): $(STAMP) gpusched/daemon/execjob.c
	@$(BIN)/python -m gpusched.daemon.execjob_build && touch $(EXECJOB) \
		|| echo "note: each job's child is a forked Python process (slower starts, the same job)"

## `gpusched` itself as a C program for the plain submit (cli/gpusched_cli/front.c), installed over the console
## script: `gpusched submit` without a Python start (~7 ms a submit against ~60 here); every other command line
## runs the Python program as before. Optional too: without a C compiler the console script stays.
FRONT := $(VENV)/.front-built
$(FRONT): $(STAMP) cli/gpusched_cli/front.c
	@$(BIN)/python -m gpusched_cli.front_build && touch $(FRONT) \
		|| echo "note: gpusched stays the Python console script (the same program, a Python start slower)"

native: $(NATIVE) $(EXECJOB) $(FRONT)

## Run the daemon on simulated GPUs with a small demo workload, then shut it down.
demo: $(STAMP) $(NATIVE) $(EXECJOB) $(FRONT)
	$(BIN)/python -m gpusched_cli.demo

## Tools the tests use from the host: systemd-analyze verifies the unit, tmux drives `top`, Slurm and munge run
## the one-host cluster (tests/integration/test_slurm_cluster.py). Installed when we are root and one is missing
## (CI); otherwise, or when apt-get fails (offline), the test that needs it says how to get it and the others
## run. The tests never use the packages' own services.
host-tools:
	@if ! command -v systemd-analyze >/dev/null 2>&1 || ! command -v tmux >/dev/null 2>&1 \
			|| ! PATH="$$PATH:/usr/sbin" command -v slurmctld >/dev/null 2>&1 \
			|| ! PATH="$$PATH:/usr/sbin" command -v munged >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
				systemd tmux slurm-wlm munge \
			|| echo "note: apt-get could not install systemd tmux slurm-wlm munge (offline?); the tests that need them say how to install them"; \
		else \
			echo "note: systemd-analyze, tmux, slurmctld or munged missing; the tests that need them say how to install them"; \
		fi; \
	fi

## Run the whole test suite plus lint and type checks. The tests run in one process per core (at most 4,
## pytest-xdist; 644 s in one process, 348 s in two on 2 cores), each test file in one process, so a file's
## module-wide fixtures (a Slurm cluster) start once. `pytest tests/...` alone runs in one process.
test: $(STAMP) $(NATIVE) $(EXECJOB) $(FRONT) host-tools
	$(BIN)/ruff check gpusched cli tests bench
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n auto --maxprocesses 4 --dist loadfile

lint: $(STAMP)
	$(BIN)/ruff check gpusched cli tests bench

typecheck: $(STAMP)
	$(BIN)/mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache gpusched/core/_native gpusched/core/_native.new \
		gpusched/daemon/_execjob
