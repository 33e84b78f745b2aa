# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
# Each creates its own virtual environment.
PYTHON ?= python3
DEMO_VENV := .venv-demo
TEST_VENV := .venv-test
TORCH_VERSION ?= 2.13.0

.PHONY: demo test clean

$(DEMO_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(DEMO_VENV)
	$(DEMO_VENV)/bin/pip install -q --upgrade pip
	$(DEMO_VENV)/bin/pip install -q -e .
	touch $@

demo: $(DEMO_VENV)/.installed
	$(DEMO_VENV)/bin/symmem estimate --model gpt2 --batch 8 --seq 1024 --precision bf16-mixed --optimizer adamw
	$(DEMO_VENV)/bin/symmem estimate --config examples/gpt2-medium/config.json --batch 4 --seq 1024 --precision fp32 --optimizer sgd --device cpu

# torch is pinned and installed before the extras: an unpinned torch would pull a multi-GB CUDA build.
$(TEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(TEST_VENV)
	$(TEST_VENV)/bin/pip install -q --upgrade pip
	$(TEST_VENV)/bin/pip install -q torch==$(TORCH_VERSION)
	$(TEST_VENV)/bin/pip install -q -e '.[torch,test]'
	touch $@

test: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python -m pytest -q

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) build *.egg-info
