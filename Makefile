# The two commands in the README. Extra arguments: make test ARGS="tests/gpu/test_x.py -x"
ARGS ?=

.PHONY: run test setup clean

run:
	@bash scripts/run.sh $(ARGS)

test:
	@bash scripts/test.sh $(ARGS)

setup:
	@bash scripts/setup.sh

# Removes the virtualenv; the downloaded model stays in ~/.cache/fmserve/models.
clean:
	rm -rf .venv build *.egg-info .pytest_cache
