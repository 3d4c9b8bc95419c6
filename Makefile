# flask_idem developer commands. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# The sample app's embedded database for `make run` and `make migrate` without DATABASE_URL.
DEV_DATABASE_URL := sqlite:///$(CURDIR)/instance/flask_idem.sqlite3
PORT ?= 5000

.PHONY: install test run migrate pg-start pg-stop lint bench bench-quick clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[sample,tests,dev]'
	touch $(STAMP)

migrate: install
	mkdir -p instance
	DATABASE_URL="$${DATABASE_URL:-$(DEV_DATABASE_URL)}" $(BIN)/alembic upgrade head

run: install
	mkdir -p instance
	DATABASE_URL="$${DATABASE_URL:-$(DEV_DATABASE_URL)}" $(BIN)/alembic upgrade head
	DATABASE_URL="$${DATABASE_URL:-$(DEV_DATABASE_URL)}" $(BIN)/python -m sample_app --port $(PORT)

# Without DATABASE_URL the test session starts (and always stops) its own cluster under .pg/;
# with it, the tests run in a fresh database on that server.
test: install
	@$(BIN)/python -m tests.pgcluster check
	$(BIN)/python -m pytest $(PYTEST_ARGS)

pg-start: install
	@$(BIN)/python -m tests.pgcluster start dev

pg-stop:
	@$(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON)) -m tests.pgcluster stop dev

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean: pg-stop
	rm -rf $(VENV) .pg instance build dist *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
