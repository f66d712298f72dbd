# Quickstart: `make demo` runs the main job on embedded defaults; `make test` runs the suite.
# Both create .venv and install what they need (torch pinned to the CPU wheel; redis-server when missing).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: beauty-items install redis test lint demo proto clean

install: $(STAMP)

# The editable install maps the wheel's packages (the product: pyproject.toml); recsvc-checkout.pth puts this
# checkout on the venv's path too, so that bench/ and harness/ (`recsvc bench`, the drills, the tests) import there.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -c 'import pathlib, sys, sysconfig; pathlib.Path(sysconfig.get_paths()["purelib"], "recsvc-checkout.pth").write_text(sys.argv[1] + "\n")' "$(CURDIR)"
	$(PY) -m pip check
	touch $(STAMP)

redis:
	@command -v redis-server >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq redis-server)

lint: install
	$(VENV)/bin/ruff check .

test: install redis
	$(VENV)/bin/ruff check .
	OMP_NUM_THREADS=1 $(VENV)/bin/pytest -x --timeout 900 -p no:cacheprovider

demo: install
	$(VENV)/bin/recsvc demo --out artifacts/demo

clean:
	rm -rf artifacts .pytest_cache .ruff_cache

# The Beauty acceptance runs (hours of CPU in all; each writes JSON under artifacts/beauty/bench).
# BEAUTY: the split directory made by `recsvc data prepare-amazon ... --out data/beauty`; another place:
# `make beauty-bundle BEAUTY=/path/to/split`.
BEAUTY ?= data/beauty
BUNDLE ?= artifacts/beauty/bundle
# the item ids beside the bundle (another catalog: `make beauty-bundle BEAUTY=/path/to/split
# BUNDLE=artifacts/other/bundle BENCH=artifacts/other/bench` keeps Beauty's ids, bundle and figures apart)
IDS ?= $(dir $(BUNDLE))ids
# the weight of the ids' collaborative term (LETTER-style: a train-period SASRec's item table; 0: text only),
# chosen on validation (docs/QUALITY.md)
CF_WEIGHT ?= 0.1
# the target's selection budget: the warmup/cosine schedule is sized to the epochs that fit it (--fit-budget).
# 25 min fits Beauty the 5 epochs that a catalog with 2.5x its interactions gets from a 55-minute budget.
TARGET_MINUTES ?= 25
# the target's preset (`recsvc tune capacity` compares presets on validation)
PRESET ?= small
# threads of the target build and how the deploy refit runs (scratch: a fresh model under the selection run's
# schedule, stopped at the chosen epoch;
# continue: one more epoch of the chosen model over train + valid, cheaper on large catalogs)
TARGET_THREADS ?= 2
REFIT ?= scratch
# the dense head's loss weight beside the LM loss (LIGER-style: the last hidden state predicts the next item's text
# embedding; chosen on validation, docs/QUALITY.md "A dense head beside the codes"; 0: off)
DENSE_HEAD ?= 1.0
# the target's seed (its initialisation and batch order)
SEED ?= 0
# SASRec's time bound (early stopping ends it first on an idle 2-core machine); tune mix and eval share its fits
SASREC_MINUTES ?= 30
# each Optuna tuning's time bound (tune prior / tune mix: --budget-minutes; --trials ends it first when sooner)
TUNE_MINUTES ?= 25
BENCH ?= artifacts/beauty/bench
.PHONY: beauty-bundle beauty-ids beauty-target recipe-reproduce beauty-seeds quality-beauty weak-target-beauty engine-beauty spec-beauty bench-beauty drafters-beauty drafters-beauty-alpha drafters-beauty-test drafters-beauty-seeds \
	drafters-beauty-alpha10 drafters-beauty-wide
# the whole recipe: the ids, then the target and its tunings over them
beauty-bundle: install
	$(MAKE) beauty-ids
	$(MAKE) beauty-target

# The recipe is code (training/recipe/recipes.py: the stages, their parameters as served); `recsvc build --recipe`
# runs a range of its stages, skips those bundle.json records as done, and prints each stage's commands
# (`--dry-run`: the commands alone). The Makefile's variables override the stages' parameters (--set).
RECIPE = $(VENV)/bin/recsvc build --recipe served --data $(BEAUTY) --out $(BUNDLE) --ids $(IDS)/semantic_ids.json

# the ids: a train-period SASRec (its item table: the ids' collaborative term), then the RQ-VAE ids
beauty-ids: install
	$(RECIPE) --to ids --set ids.cf_weight=$(CF_WEIGHT) ids.sasrec_max_minutes=$(SASREC_MINUTES)

# the target and every tuning over existing ids (prior x2, mix x2, history, dense, fresh), then the draft head;
# another draw of the recipe on the same ids: `make beauty-target SEED=2 BUNDLE=artifacts/beauty-s2/bundle
# IDS=artifacts/beauty/ids`
beauty-target: install
	$(RECIPE) --from target --set target.preset=$(PRESET) target.refit=$(REFIT) target.threads=$(TARGET_THREADS) \
	  target.max_minutes=$(TARGET_MINUTES) target.seed=$(SEED) target.dense_head=$(DENSE_HEAD) \
	  sasrec_max_minutes=$(SASREC_MINUTES) budget_minutes=$(TUNE_MINUTES)

# the item-level target's recipe (training/recipe/recipes.py SERVED_ITEMS; docs/QUALITY.md "The item-level target"):
# the same ids (`make beauty-ids`), then a timeline over items and a small code decoder with the same tunings, in
# a bundle of its own beside the token target's
ITEMS_BUNDLE ?= artifacts/beauty-items/bundle
beauty-items: install
	$(VENV)/bin/recsvc build --recipe served-items --data $(BEAUTY) --out $(ITEMS_BUNDLE) --ids $(IDS)/semantic_ids.json

# docs/QUALITY.md "The recipe as code computes what the Makefile did": the recipe's stages run by the code of the
# last commit whose recipe lived in the Makefile and by this tree's, side by side on one thread each, same lines and
# seed, compared leaf by leaf and weight file by file (a 1-epoch schedule, 6 trials per search and a smaller head:
# 68 minutes on a 2-core AVX2 EPYC, most of it the full-decode trials)
REPRODUCE ?= artifacts/reproduce
recipe-reproduce: install
	$(VENV)/bin/recsvc bench reproduce --data $(BEAUTY) --ids $(IDS)/semantic_ids.json --out $(REPRODUCE) \
	  --set target.epochs=1 target.fit_budget=false target.max_minutes=none trials=6 head.prefixes=3000 \
	  head.epochs=2 --json $(REPRODUCE)/compare.json

# three seeds of the recipe on the same ids (about 40 min each on two threads), each evaluated as served, then the
# mean of their ratios with one interval (docs/QUALITY.md "Three seeds of today's recipe")
SEEDS ?= 0 1 2
beauty-seeds: install
	for s in $(SEEDS); do $(MAKE) beauty-target SEED=$$s BUNDLE=artifacts/beauty-s$$s/bundle IDS=$(IDS) || exit 1; \
	  mkdir -p artifacts/beauty-s$$s/bench; $(VENV)/bin/recsvc eval --bundle artifacts/beauty-s$$s/bundle --split test \
	  --k 5,10,20 --baselines $(QUALITY_BASELINES) --protocol deploy --cache-dir artifacts/baselines \
	  --sasrec-max-minutes $(SASREC_MINUTES) --json artifacts/beauty-s$$s/bench/quality_deploy.json || exit 1; done
	mkdir -p artifacts/beauty-seeds
	$(VENV)/bin/recsvc eval summarize $(foreach s,$(SEEDS),artifacts/beauty-s$(s)/bench/quality_deploy.json) \
	  --json artifacts/beauty-seeds/summary.json

# the quality comparison (BENCHMARKS.md "Quality"): the served target beside the baselines, both protocols
QUALITY_BASELINES ?= popularity,transition,transition-window,sasrec
quality-beauty: install
	mkdir -p $(BENCH)
	@# as served (history items left out or kept as `recsvc tune history` chose on validation), then the other way
	for ex in "" "--keep-history" "--exclude-history"; do $(VENV)/bin/recsvc eval --bundle $(BUNDLE) --split test \
	  --k 5,10,20 --baselines $(QUALITY_BASELINES) --protocol deploy --cache-dir artifacts/baselines \
	  --sasrec-max-minutes $(SASREC_MINUTES) $$ex --json $(BENCH)/quality_deploy$${ex:+_$${ex#--}}.json || exit 1; done
	$(VENV)/bin/recsvc eval --bundle $(BUNDLE) --split test --k 5,10,20 \
	  --baselines $(QUALITY_BASELINES) --protocol paper --cache-dir artifacts/baselines --sasrec-max-minutes $(SASREC_MINUTES) \
	  --json $(BENCH)/quality_paper.json
	@# the dense head's share of the served lists: the same bundle with and without it, user by user
	if [ -f $(BUNDLE)/target/dense_head.safetensors ]; then $(VENV)/bin/recsvc eval --bundle $(BUNDLE) --split test \
	  --k 10,20 --against-variant no-dense --json $(BENCH)/quality_dense_effect.json; fi

# docs/QUALITY.md "A target too weak for its catalog": the recipe's tuning and evaluation around a target trained
# for one epoch (the ids of the Beauty recipe; ~10 min on 2 threads): does validation see that the fused target
# falls below its own prior?
WEAK ?= artifacts/beauty-weak
weak-target-beauty: install
	$(VENV)/bin/recsvc build --recipe weak --data $(BEAUTY) --out $(WEAK)/bundle --ids $(IDS)/semantic_ids.json \
	  --set sasrec_max_minutes=$(SASREC_MINUTES)
	$(VENV)/bin/recsvc eval --bundle $(WEAK)/bundle --split test --k 10,20 --baselines sasrec --protocol deploy \
	  --cache-dir artifacts/baselines --sasrec-max-minutes $(SASREC_MINUTES) --json $(WEAK)/quality_deploy.json

# an SFT LLaMA drafter for the benches (~3.5 min), unless one exists (make drafters-beauty trains a longer one)
SFT_DRAFTER = test -f $(BUNDLE)/drafters/sft/config.json || $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) \
  --preset drafter-small --method sft --epochs 2 --threads 1 --out-name sft

# BENCHMARKS.md "Speculation with the fused target": the oracle ceiling, the draft head, the transition and
# LLaMA drafters on the served bundle (one thread, fp32; ~6 min, +3.5 with the drafter; an otherwise idle machine)
SPEC = $(VENV)/bin/recsvc bench speculative --bundle $(BUNDLE) --dtype fp32 --threads 1
spec-beauty: install
	mkdir -p $(BENCH)
	$(SPEC) --users 200 --k 1,5,10,20 --drafter oracle --grid K:3 --json $(BENCH)/spec_oracle.json
	$(SPEC) --users 500 --k 10 --drafter head --grid K:3,2K:3 --json $(BENCH)/spec_head_k10.json
	$(SPEC) --users 200 --k 1,5,20 --drafter head --grid K:3,2K:3 --json $(BENCH)/spec_head.json
	$(SPEC) --users 200 --k 10 --drafter head --head-opener none --grid K:3,2K:3 --json $(BENCH)/spec_head_noopener.json
	$(SPEC) --users 200 --k 10 --drafter transition --grid K:3,2K:3 --json $(BENCH)/spec_transition.json
	$(SPEC) --users 200 --k 10 --mode relaxed --drafter head --grid K:3,2K:3 --json $(BENCH)/spec_head_relaxed.json
	$(SFT_DRAFTER)
	$(SPEC) --users 200 --k 10 --drafter llama --drafter-name sft --grid K:3,2K:3,K:1 --json $(BENCH)/spec_llama.json

# BENCHMARKS.md "The fast forward and the user-state cache", the replay and bench serve rows (fp32, one thread;
# ~12 min on an otherwise idle 2-core machine)
engine-beauty: install redis
	mkdir -p $(BENCH)
	$(VENV)/bin/recsvc bench cache --bundle $(BUNDLE) --users 200 --k 10 --beam-width 20 --dtype fp32 --threads 1 \
	  --json $(BENCH)/cache.json
	$(VENV)/bin/recsvc bench cache --bundle $(BUNDLE) --users 200 --k 10 --beam-width 20 --dtype bf16 --threads 1 \
	  --json $(BENCH)/cache_bf16.json
	@# the LLaMA drafter's fixed cost per forward
	$(SFT_DRAFTER)
	$(VENV)/bin/recsvc bench cache --bundle $(BUNDLE) --users 200 --k 10 --beam-width 20 --dtype fp32 --threads 1 \
	  --llama-drafter sft --json $(BENCH)/cache_drafter.json
	$(VENV)/bin/recsvc bench replay --bundle $(BUNDLE) --users 150 --r 3 --k 10 --concurrency 1,16 \
	  --cache lean,off,on,ahead,compiled --max-seconds 45 --dtype fp32 --threads 1 --json $(BENCH)/replay.json
	OMP_NUM_THREADS=1 $(VENV)/bin/recsvc bench serve --bundle $(BUNDLE) --concurrency 1,16 --duration 30 --k 10 \
	  --batching both --dtype fp32 --json $(BENCH)/serve.json

bench-beauty: install redis
	mkdir -p $(BENCH)
	$(VENV)/bin/recsvc eval --bundle $(BUNDLE) --split test --k 1,5,10,20 --json $(BENCH)/eval_test.json
	$(VENV)/bin/recsvc bench decode --bundle $(BUNDLE) --users 200 --k 1,5,10,20 --json $(BENCH)/decode.json
	$(VENV)/bin/recsvc bench speculative --bundle $(BUNDLE) --users 200 --k 1,3,5,10,20 --drafter oracle \
	  --grid K:3,K:2,2K:3 --attention exact --json $(BENCH)/spec_oracle.json
	$(VENV)/bin/recsvc bench speculative --bundle $(BUNDLE) --users 500 --k 10,20 --drafter llama --grid K:3 \
	  --attention exact --json $(BENCH)/spec_identical.json
	$(VENV)/bin/recsvc bench speculative --bundle $(BUNDLE) --users 200 --k 1,3,5,10,20 --drafter llama \
	  --grid K:3,K:1,2K:3 --json $(BENCH)/spec_llama.json
	$(VENV)/bin/recsvc bench speculative --bundle $(BUNDLE) --users 200 --k 1,3,5,10,20 --drafter retrieval \
	  --grid K:3,K:1,2K:3 --json $(BENCH)/spec_retrieval.json
	$(VENV)/bin/recsvc bench speculative --bundle $(BUNDLE) --users 200 --k 1,5,10,20 --drafter llama \
	  --mode relaxed --grid K:3,2K:3 --json $(BENCH)/spec_relaxed.json
	$(VENV)/bin/recsvc bench serve --bundle $(BUNDLE) --concurrency 1,16 --duration 30 --k 10 --batching both \
	  --speculation both --json $(BENCH)/serve.json
	$(VENV)/bin/recsvc bench serve --bundle $(BUNDLE) --concurrency 16 --duration 60 --k 10 --redis-url spawn \
	  --outage --json $(BENCH)/serve_outage.json
	$(VENV)/bin/recsvc bench fuzz --bundle $(BUNDLE) --requests 10000 --json $(BENCH)/fuzz.json

# drafter alignment on Beauty (BENCHMARKS.md "Drafter alignment"): teacher data, the six methods, the Table-1 run.
# One thread per job; run two jobs side by side on a 2-core machine for ~1 h in all.
ALPHA ?= 0.5
DRAFTER_EPOCHS ?= 2
drafters-beauty: install
	$(VENV)/bin/recsvc train teacher --bundle $(BUNDLE) --k 20 --threads 1
	$(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) --preset drafter-small --method sft --epochs 4 \
	  --threads 1 --out-name sft
	for m in wordkd tvdkd; do $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) --preset drafter-small \
	  --method $$m --alpha $(ALPHA) --epochs $(DRAFTER_EPOCHS) --threads 1 --out-name $$m || exit 1; done
	for m in seqkd atspeed-s atspeed-r; do $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) \
	  --preset drafter-small --method $$m --alpha $(ALPHA) --k 10 --epochs $(DRAFTER_EPOCHS) --threads 1 \
	  --out-name $$m || exit 1; done
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --methods sft,wordkd,tvdkd,seqkd,atspeed-s,atspeed-r \
	  --k 1,5,10,20 --users 200 --threads 1 --json $(BENCH)/drafters.json

# the alpha grid (after drafters-beauty): every alignment method at alpha 0.7 and 0.9 (named M-a07, M-a09), then
# the selection runs on 1,000 validation users (strict and relaxed AS@10, N = K); ~2.5 h on one core.
ALIGN_METHODS := wordkd tvdkd seqkd atspeed-s atspeed-r
drafters-beauty-alpha: install
	for a in 07 09; do for m in $(ALIGN_METHODS); do $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) \
	  --preset drafter-small --method $$m --alpha 0.$${a#0} --k 10 --epochs $(DRAFTER_EPOCHS) --threads 1 \
	  --out-name $$m-a$$a || exit 1; done; done
	for a in 07 09; do $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) --preset drafter-small \
	  --method atspeed-r --support trie --alpha 0.$${a#0} --k 10 --epochs $(DRAFTER_EPOCHS) --threads 1 \
	  --out-name atspeed-r-trie-a$$a || exit 1; done
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --split valid --users 1000 --k 10 --threads 1 \
	  --methods sft,$$(for m in $(ALIGN_METHODS); do printf '%s,%s-a07,%s-a09,' $$m $$m $$m; done)atspeed-r-trie-a07,atspeed-r-trie-a09 \
	  --json $(BENCH)/alpha_valid.json

# wide trees (BENCHMARKS.md, "Drafter alignment", N = 40): the SFT drafter trained 2 more epochs (sft-cont), then
# AtSpeed-S from it, aligned on the teacher's 20 beams (K = 20 in the loss) over every training prefix, one epoch
# at each alpha of WIDE_ALPHAS (named atspeed-s-all-aXX); strict AS@10 at N = 4K on 1,000 validation users (the
# SFT drafters beside them) chooses the alpha, then every test user (~1.7 h on one core; the teacher data ~33 min)
WIDE_ALPHAS ?= 05 025
space := $(subst ,, )
WIDE_BENCH = $(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --k 10 --n-mult 4 --seed 1 --modes strict \
  --threads 1 --methods sft,sft-cont,$(subst $(space),$(comma),$(strip $(foreach a,$(WIDE_ALPHAS),atspeed-s-all-a$(a))))
drafters-beauty-wide: install
	$(VENV)/bin/recsvc train teacher --bundle $(BUNDLE) --k 20 --threads 1
	$(SFT_DRAFTER)
	test -f $(BUNDLE)/drafters/sft-cont/config.json || $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) \
	  --preset drafter-small --method sft --epochs 2 --lr 3e-4 --init-from sft --draft-beams 40 --threads 1 \
	  --out-name sft-cont
	for a in $(WIDE_ALPHAS); do $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) --preset drafter-small \
	  --method atspeed-s --alpha 0.$${a#0} --k 20 --epochs 1 --lr 3e-4 --init-from sft-cont --draft-beams 40 \
	  --threads 1 --out-name atspeed-s-all-a$$a || exit 1; done
	mkdir -p $(BENCH)
	$(WIDE_BENCH) --split valid --users 1000 --json $(BENCH)/drafters_wide_valid.json
	$(WIDE_BENCH) --split test --users 5000 --json $(BENCH)/drafters_wide_test.json

# the test comparison: each method at the alpha its validation AS@10 chose (BENCHMARKS.md, "Drafter
# alignment"), 1,000 test users (seed 1), K = 10, N = K, strict and relaxed.
CHOSEN ?= sft,wordkd-a09,tvdkd-a09,seqkd-a09,atspeed-s-a09,atspeed-r-a09,atspeed-r-trie-a09
drafters-beauty-test: install
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --methods $(CHOSEN) --k 10 --users 1000 --seed 1 \
	  --threads 1 --json $(BENCH)/drafters_chosen_test.json

# the relaxed comparison across training seeds (after drafters-beauty-alpha): the relaxed contenders at alpha 0.9
# retrained with --seed 1 and 2 (named M-s1, M-s2), every seed measured on all Beauty test users, then the
# per-seed table with paired 95% intervals against AtSpeed-R (BENCHMARKS.md, "Across training seeds").
SEEDED := wordkd-a09 seqkd-a09 atspeed-r-a09 atspeed-r-trie-a09
drafters-beauty-seeds: install
	for s in 1 2; do for m in $(SEEDED); do case $$m in wordkd*) x="--method wordkd";; \
	  atspeed-r-trie*) x="--method atspeed-r --k 10 --support trie";; *) x="--method $${m%-a09} --k 10";; esac; \
	  $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) --preset drafter-small $$x --alpha 0.9 \
	  --epochs $(DRAFTER_EPOCHS) --threads 1 --seed $$s --out-name $$m-s$$s || exit 1; done; done
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --modes relaxed --k 10 --users 5000 --seed 1 --threads 1 \
	  --methods tvdkd-a09,$$(for m in $(SEEDED); do printf '%s,%s-s1,%s-s2,' $$m $$m $$m; done | sed 's/,$$//') \
	  --json $(BENCH)/seeds/relaxed.json
	for r in atspeed-r-a09 atspeed-r-trie-a09; do $(VENV)/bin/recsvc bench seeds --json $(BENCH)/seeds/relaxed.json \
	  --mode relaxed --k 10 --reference $$r --out $(BENCH)/seeds/summary_$$r.json || exit 1; done
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --modes strict --k 10 --users 5000 --seed 1 --threads 1 \
	  --methods atspeed-s-a09,wordkd-a09,wordkd-a09-s1,wordkd-a09-s2 --json $(BENCH)/seeds/strict.json
	$(VENV)/bin/recsvc bench seeds --json $(BENCH)/seeds/strict.json --mode strict --k 10 --reference atspeed-s-a09 \
	  --out $(BENCH)/seeds/summary_strict.json

# alpha 1.0 (no recommendation loss) for the contenders, chosen on validation, then measured on all test users
# beside the seed study's files (BENCHMARKS.md, "Alpha 1.0 on test"; run drafters-beauty-seeds first).
drafters-beauty-alpha10: install
	for m in wordkd seqkd atspeed-s atspeed-r-trie; do case $$m in wordkd) x="--method wordkd";; \
	  atspeed-r-trie) x="--method atspeed-r --k 10 --support trie";; *) x="--method $$m --k 10";; esac; \
	  $(VENV)/bin/recsvc train drafter --bundle $(BUNDLE) --preset drafter-small $$x --alpha 1.0 \
	  --epochs $(DRAFTER_EPOCHS) --threads 1 --out-name $$m-a10 || exit 1; done
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --split valid --users 1000 --k 10 --threads 1 --modes relaxed \
	  --methods wordkd-a10,seqkd-a10,atspeed-r-trie-a10 --json $(BENCH)/alpha_valid_a10_relaxed.json
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --split valid --users 1000 --k 10 --threads 1 --modes strict \
	  --methods wordkd-a10,atspeed-s-a10 --json $(BENCH)/alpha_valid_a10_strict.json
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --modes relaxed --k 10 --users 5000 --seed 1 --threads 1 \
	  --methods wordkd-a10,seqkd-a10,atspeed-r-trie-a10 --json $(BENCH)/seeds/relaxed_a10.json
	$(VENV)/bin/recsvc bench drafters --bundle $(BUNDLE) --modes strict --k 10 --users 5000 --seed 1 --threads 1 \
	  --methods wordkd-a10 --json $(BENCH)/seeds/strict_a10.json
	$(VENV)/bin/recsvc bench seeds --json $(BENCH)/seeds/relaxed.json,$(BENCH)/seeds/relaxed_a10.json --mode relaxed \
	  --k 10 --reference atspeed-r-trie-a10 --out $(BENCH)/seeds/summary_a10_relaxed.json
	$(VENV)/bin/recsvc bench seeds --json $(BENCH)/seeds/strict.json,$(BENCH)/seeds/strict_a10.json --mode strict \
	  --k 10 --reference atspeed-s-a09 --out $(BENCH)/seeds/summary_a10_strict.json

# Plots of the JSON above (`recsvc report`; docs/QUALITY.md, BENCHMARKS.md): whichever of these files exist under
# $(BENCH), and the target's training record, as PNG + SVG under REPORT_OUT. REPORT_MACHINE names the machine where a
# file does not record it (recsvc eval JSON, training records); the benches record their own.
REPORT_OUT ?= docs/img
REPORT_LABEL ?= Amazon Beauty
REPORT_MACHINE ?=
REPORT_JSON := quality_deploy quality_paper quality_dense_effect quality_selection eval_test decode spec_oracle spec_identical spec_llama spec_retrieval \
	spec_relaxed spec_head_k10 spec_head spec_head_noopener spec_transition spec_head_relaxed cache cache_bf16 \
	cache_drafter replay serve
REPORT_FILES = $(wildcard $(REPORT_JSON:%=$(BENCH)/%.json) $(BUNDLE)/target/training.json)
.PHONY: report
report: install
	@test -n "$(strip $(REPORT_FILES))" || { echo "make report: no eval / bench JSON (REPORT_JSON) under $(BENCH) and \
	no $(BUNDLE)/target/training.json: make quality-beauty, spec-beauty, engine-beauty or bench-beauty first" >&2; exit 2; }
	$(VENV)/bin/recsvc report --out $(REPORT_OUT) --label "$(REPORT_LABEL)" \
	  $(if $(REPORT_MACHINE),--machine "$(REPORT_MACHINE)") $(REPORT_FILES)

# The engine on a GPU (docs/GPU.md). `make gpu-bench`: the acceptance figures in one prepared script of <= 7
# minutes (bench/gpu_accept.py): the smoke run first (tiny presets, same device), then a Beauty bundle
# (bf16 base target, llama-68m drafter aligned with AtSpeed-S) and plain / strict / relaxed / batched / host-read
# figures at K = 10 of width 20; JSON after each stage under GPU_OUT. It runs with the venv's python when there
# is one, else the machine's python3 (a GPU image with torch + transformers: no gRPC needed), the repository
# on PYTHONPATH. GPU_ARGS=--smoke: the smoke run alone (on a CPU: under a minute).
# `make gpu-bench-long`: the older ~20 minute sweep (K = 1..20, oracle / head / llama drafters).
GPU_OUT ?= artifacts/gpu-bench
GPU_ARGS ?=
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
.PHONY: gpu-bench gpu-bench-long
gpu-bench:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.gpu_accept $(if $(findstring --smoke,$(GPU_ARGS)),,--data $(BEAUTY)) \
	  --out $(GPU_OUT) $(GPU_ARGS)
# `make gpu-bundle`: the served bundle slimmed for a GPU machine (GPU_BUNDLE, ~52 MiB: what serving reads, the
# target's weights in bf16; bench/gpu_bundle.py),
# then on that machine `make gpu-bench-served` (no smoke, no build: the served target and its draft head, the prior
# fused as served, every stage incl. compiled-graphs; about 2-3 minutes).
SERVED ?= artifacts/beauty/bundle
GPU_BUNDLE ?= cache/served
.PHONY: gpu-bundle gpu-bench-served
gpu-bench-served:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m bench.gpu_accept --bundle $(GPU_BUNDLE) --data $(BEAUTY) --drafter-kind head \
	  --n 20 --out $(GPU_OUT)-served $(GPU_ARGS)
gpu-bundle:
	$(PY) -m bench.gpu_bundle --from $(SERVED) --to $(GPU_BUNDLE)
# `make gpu-capacity` (on that machine, with the slimmed bundle's ids): the recipe's target at each of
# CAPACITY_PRESETS, each with the same training budget (5 minutes, fewer when its 10 epochs fit sooner), batch and
# seed, compared on validation against the first, paired per user (`recsvc tune capacity`,
# training/tuning/capacity.py; at most 8 minutes in all).
CAPACITY_PRESETS ?= small,base
CAPACITY_IDS ?= $(GPU_BUNDLE)/ids/semantic_ids.json
.PHONY: gpu-capacity
gpu-capacity:
	PYTHONPATH=$(CURDIR) $(GPU_PY) -m training.tuning.capacity --data $(BEAUTY) --ids $(CAPACITY_IDS) \
	  --out $(GPU_OUT)-capacity --presets $(CAPACITY_PRESETS) --epochs 10 --preset-minutes 5 --batch-size 128 \
	  --budget-minutes 8 --sasrec-max-minutes 1 $(GPU_ARGS)
gpu-bench-long:
	test -x $(PY) || (echo "no $(VENV): carry the venv or run make install (see docs/GPU.md)"; exit 2)
	$(VENV)/bin/recsvc bench gpu $(if $(findstring --smoke,$(GPU_ARGS)),,--data $(BEAUTY)) --out $(GPU_OUT)-long $(GPU_ARGS)

# The container image (deploy/README.md, "Building the image"). `make image` builds IMAGE with BuildKit from
# BASE_IMAGE, or, where that cannot be pulled, from LOCAL_BASE made by `make base-image` (Debian's packages via
# debootstrap; root). The torch CPU wheel is taken from this host when pip finds it locally (copied into .whl/),
# else the Dockerfile downloads it from torch's CPU index. BUILD_CA: a CA bundle pip trusts during the build
# (a TLS-inspecting proxy; default: pip's own PIP_CERT). DOCKER: a client with BuildKit (buildx, or a 20.10 client;
# default: the first such client here, deploy/docker/pick-docker.sh).
# `make image-smoke` builds the image of this checkout, runs it with a tiny bundle (target and drafter, built here
# by the repository's commands) and checks it from outside (deploy/docker/image_smoke.py).
IMAGE ?= recsvc:0.1.0-cpu
BASE_IMAGE ?= python:3.11-slim
LOCAL_BASE ?= recsvc-base:bookworm
DOCKER ?=
BUILD_CA ?= $(PIP_CERT)
TORCH_WHEEL_PIN := torch==2.13.0+cpu
comma := ,
SMOKE_DIR ?= artifacts/image-smoke
SMOKE_GRACE_S ?= 10
# the client that builds: DOCKER when given, else the first of docker on PATH, /usr/bin/docker, /usr/local/bin/docker
# that has buildx or is a 20.10 client (deploy/docker/pick-docker.sh prints "PATH buildx|buildkit"; when none can
# build it stops with the one line that fixes it)
PICK_DOCKER = picked=$$(deploy/docker/pick-docker.sh "$(DOCKER)") || exit 2; docker=$${picked% *}; \
  case $$picked in *buildx) build="$$docker buildx build --load";; *) build="env DOCKER_BUILDKIT=1 $$docker build";; esac
PIP_WHEEL = $(PY) -m pip download --no-deps --only-binary=:all: --python-version 3.11 --implementation cp \
  --platform manylinux_2_28_x86_64 --dest .whl
.PHONY: image base-image image-wheels image-smoke
base-image:
	@$(PICK_DOCKER); $$docker image inspect $(LOCAL_BASE) >/dev/null 2>&1 || \
	  PATH="$$(dirname $$docker):$$PATH" deploy/docker/base-image.sh $(LOCAL_BASE)

image-wheels: install
	@ls .whl/torch-2.13.0+cpu-*.whl >/dev/null 2>&1 || $(PIP_WHEEL) --no-index $(TORCH_WHEEL_PIN) \
	  || echo "no local $(TORCH_WHEEL_PIN) wheel: the build downloads it from torch's CPU index"

image: image-wheels
	@$(PICK_DOCKER); echo "docker client: $$picked"; base=$(BASE_IMAGE); \
	if ! $$docker image inspect $$base >/dev/null 2>&1 && ! $$docker pull $$base; then \
	  echo "cannot pull $$base: building on $(LOCAL_BASE) (make base-image)"; \
	  $(MAKE) base-image DOCKER=$$docker && base=$(LOCAL_BASE) || exit 1; \
	fi; \
	set -x; $$build --build-arg BASE_IMAGE=$$base $(if $(BUILD_CA),--secret id=build-ca$(comma)src=$(BUILD_CA)) \
	  -t $(IMAGE) . && $$docker image ls $(IMAGE)

image-smoke: install
	test -f $(SMOKE_DIR)/data/items.json || $(VENV)/bin/recsvc data synth --out $(SMOKE_DIR)/data --items 80 \
	  --users 160 --seed 0
	test -f $(SMOKE_DIR)/bundle/drafter/config.json || $(VENV)/bin/recsvc build --data $(SMOKE_DIR)/data \
	  --out $(SMOKE_DIR)/bundle --preset tiny --epochs 1 --prompt compact --window-stride 5 --recall-users 64 \
	  --eval-users 64 --drafter-preset drafter-tiny --drafter-epochs 1 --threads 1
	@# a bundle built before bundles held what serving reads (popularity, calibration histories): add them
	test -f $(SMOKE_DIR)/bundle/popularity.json || $(VENV)/bin/recsvc bundle serving-files --bundle $(SMOKE_DIR)/bundle
	@# safetensors writes weight files 0600: the image runs as uid 10001, which must read them (deploy/README.md)
	chmod -R a+rX $(SMOKE_DIR)/bundle
	@# the image of this checkout (the build cache makes this quick when nothing changed)
	@$(PICK_DOCKER); $(MAKE) image DOCKER=$$docker && \
	DOCKER=$$docker PYTHONPATH=$(CURDIR) $(PY) deploy/docker/image_smoke.py --image $(IMAGE) --bundle $(SMOKE_DIR)/bundle \
	  --grace-s $(SMOKE_GRACE_S) --json $(SMOKE_DIR)/smoke.json
