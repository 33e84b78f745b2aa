# Two commands on a fresh machine with Python 3.11: `make demo` and `make test`.
# Each creates its own virtual environment.
PYTHON ?= python3
DEMO_VENV := .venv-demo
TEST_VENV := .venv-test
PEERS_VENV := .venv-peers
TORCH_VERSION ?= 2.13.0

.PHONY: demo test notebooks gpu-check peers clean

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

# tests/test_render.py compiles the LaTeX report with pdflatex: a minimal TeX from Debian's
# packages (texlive-latex-base: LaTeX, amsmath, amssymb; texlive-latex-recommended: booktabs),
# about 25 s to install. Without root the test is skipped and says why. The suite runs on every
# core (pytest-xdist), each test file on one worker, and names its 25 slowest tests.
test: $(TEST_VENV)/.installed
	@command -v pdflatex >/dev/null || { if [ "$$(id -u)" = 0 ]; then \
	    echo "installing pdflatex (texlive-latex-base, texlive-latex-recommended) for the LaTeX report test"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
	      --no-install-recommends texlive-latex-base texlive-latex-recommended >/dev/null; \
	  else echo "pdflatex is missing and installing it needs root: the LaTeX report test will be skipped"; fi; }
	$(TEST_VENV)/bin/python -m pytest -q -n auto --dist loadfile --durations=25

# Run every notebook and keep its outputs (a reader on a code host sees them; make test checks
# that they are current).
notebooks: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python notebooks/execute.py

# On a machine with a CUDA GPU: real-size models trained beside symmem's CUDA prediction
# (benchmarks/gpu_check.py; its table in gpu_check.json). PyPI's torch==$(TORCH_VERSION) for Linux is
# a CUDA build.
gpu-check: $(TEST_VENV)/.installed
	$(TEST_VENV)/bin/python benchmarks/gpu_check.py --json gpu_check.json

# symmem beside its peers (benchmarks/peers/): llm-analysis and PyTorch's MemTracker on a grid of
# Hugging Face models measured on the CPU (about 4 minutes of CPU for the accuracy grid).
# A venv of its own: llm-analysis 0.2.2 declares transformers<5 and huggingface-hub<0.15; its
# memory code imports neither (only an optional AutoConfig, for fetching configs from the Hub,
# which imports from transformers 5 too), so it is installed without its declared dependencies,
# with what it does import: fire (and fire's six and termcolor). Not part of `make test`.
$(PEERS_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(PEERS_VENV)
	$(PEERS_VENV)/bin/pip install -q --upgrade pip
	$(PEERS_VENV)/bin/pip install -q torch==$(TORCH_VERSION)
	$(PEERS_VENV)/bin/pip install -q -e '.[torch]'
	$(PEERS_VENV)/bin/pip install -q fire==0.5.0 six termcolor
	$(PEERS_VENV)/bin/pip install -q --no-deps llm-analysis==0.2.2
	touch $@

peers: $(PEERS_VENV)/.installed
	$(PEERS_VENV)/bin/python benchmarks/peers/accuracy.py
	$(PEERS_VENV)/bin/python benchmarks/peers/speed.py

clean:
	rm -rf $(DEMO_VENV) $(TEST_VENV) $(PEERS_VENV) build *.egg-info
