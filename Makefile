# flask_idem developer commands. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The sample app's embedded database for `make run` and `make migrate` without DATABASE_URL.
DEV_DATABASE_URL := sqlite:///$(CURDIR)/instance/flask_idem.sqlite3
PORT ?= 5000
WITH_DATABASE_URL = DATABASE_URL="$${DATABASE_URL:-$(DEV_DATABASE_URL)}"

.PHONY: install test test-unit docs run migrate pg-start pg-stop lint bench bench-quick clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[sample,tests,dev,docs]'
	touch $(STAMP)

# Every table the sample app needs: the extension's (Alembic) and the app's own.
migrate: install
	mkdir -p instance
	$(WITH_DATABASE_URL) $(BIN)/alembic upgrade head
	$(WITH_DATABASE_URL) $(BIN)/flask --app sample_app init-db

# Prints the URL and three curl commands to try, then serves.
run: migrate
	$(WITH_DATABASE_URL) $(BIN)/python -m sample_app --port $(PORT)

# Without DATABASE_URL the test session starts (and always stops) its own cluster under .pg/;
# with it, the tests run in a fresh database on that server.
test: install
	@$(BIN)/python -m tests.support.pgcluster check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The tier that needs no database and no server (tests/unit): under a minute, also
# where PostgreSQL is missing (its conftest refuses the database fixtures).
test-unit: install
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

# The documentation site (Sphinx, furo, MyST) under docs/_build/html; warnings are errors. It
# needs no network: intersphinx reads local inventories (DOCS_INTERSPHINX=online fetches them).
docs: install
	$(BIN)/sphinx-build -W --keep-going -q -b html docs docs/_build/html

pg-start: install
	@$(BIN)/python -m tests.support.pgcluster start dev

pg-stop:
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m tests.support.pgcluster stop dev

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/lint-imports

# The A/B bench: the same endpoint bare and behind flask_idem under gunicorn on a durable throwaway PostgreSQL
# (or DATABASE_URL); prints the table and writes bench/results/*.json. BENCH_MODE=growth fills the
# table to 1, 5 and 10 million records instead; BENCH_MODE=sealing measures compression and
# encryption of stored responses, on and off; BENCH_MODE=trail the audit trail on and off; BENCH_ARGS passes options (python -m bench -h).
BENCH_MODE ?= run
BENCH_ARGS ?=
# The PostgreSQL driver every layer of the bench uses: psycopg2 or psycopg (psycopg 3).
BENCH_DRIVER ?= psycopg2

bench: install
	BENCH_DRIVER=$(BENCH_DRIVER) $(BIN)/python -m bench $(BENCH_MODE) $(BENCH_ARGS)

# The same in under a minute: 2 short rounds, 3 storms.
bench-quick: install
	BENCH_DRIVER=$(BENCH_DRIVER) $(BIN)/python -m bench run --quick $(BENCH_ARGS)

clean: pg-stop
	rm -rf $(VENV) .pg instance build dist docs/_build *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
