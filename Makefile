# Everything starts from a bare checkout and a Python 3.11 with pip.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TARGET ?= qwen2.5-coder-1.5b-instruct
DRAFT ?= qwen2.5-coder-0.5b-instruct
# Ray's token auth on (tests generate a token per session; `specdec serve` one per start).
export RAY_AUTH_MODE := token
export HF_HUB_OFFLINE := 1

.PHONY: install dev sysdeps serve test test-slow lint bench clean-venv

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Stamps re-run the install when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed
dev: $(VENV)/.installed-dev

serve: install
	$(BIN)/specdec models prepare $(TARGET) $(DRAFT)
	$(BIN)/specdec serve --target $(TARGET) --draft $(DRAFT)

# Style and the layers' import contracts (pyproject.toml) before the suite.
lint: dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/lint-imports

# tests/e2e/test_ray_up.py runs sshd, ssh, ssh-keygen, rsync, ip and unshare; the alert rules' and
# the scrape test run promtool and prometheus; the CPU attention kernel is built with gcc
# (specdec/core/cpu_attention.py; each skips, saying why, without them). As root,
# apt-get installs what is missing, once; the ssh and prometheus services the packages enable are
# turned off again (the tests start their own sshd in a private network namespace, their own
# prometheus on a free port). Whatever is still missing afterwards fails the target, naming it, so
# that no test can be skipped unnoticed.
sysdeps:
	@missing() { m=""; [ -x /usr/sbin/sshd ] || m=" sshd"; \
		for t in ssh ssh-keygen rsync ip unshare promtool prometheus gcc; do command -v $$t >/dev/null || m="$$m $$t"; done; \
		echo "$$m"; }; \
	miss=$$(missing); [ -z "$$miss" ] && exit 0; \
	pkgs=""; for t in $$miss; do \
		case $$t in sshd) p=openssh-server;; ssh|ssh-keygen) p=openssh-client;; ip) p=iproute2;; unshare) p=util-linux;; \
			promtool|prometheus) p=prometheus;; gcc) p="gcc libc6-dev";; *) p=$$t;; esac; \
		case "$$pkgs " in *" $$p "*) ;; *) pkgs="$$pkgs $$p";; esac; done; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "apt-get install$$pkgs (for tests/e2e/test_ray_up.py, the Prometheus tests and the CPU attention kernel)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$pkgs >/dev/null; \
		if echo "$$pkgs" | grep -q openssh-server && command -v systemctl >/dev/null; then \
			systemctl disable --now ssh.service ssh.socket >/dev/null 2>&1 || true; fi; \
		if echo "$$pkgs" | grep -q prometheus; then \
			if command -v systemctl >/dev/null; then systemctl disable --now prometheus.service >/dev/null 2>&1 || true; fi; \
			if [ -x /etc/init.d/prometheus ]; then /etc/init.d/prometheus stop >/dev/null 2>&1 || true; fi; fi; \
		miss=$$(missing); \
	fi; \
	if [ -n "$$miss" ]; then \
		echo "make sysdeps: missing:$$miss (needed by tests/e2e/test_ray_up.py, the Prometheus tests and the CPU attention kernel; as root with apt-get: apt-get install$$pkgs)" >&2; \
		exit 1; fi

# The unit tests in two processes (each on one torch thread, tests/conftest.py; a module stays in
# one process, so its fixtures load once); then the integration and end-to-end tests one at a time:
# they start services and clusters whose timeouts assume the machine is theirs.
test: lint sysdeps
	$(BIN)/specdec models prepare smollm2-135m-instruct
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider --durations=10 -n 2 --dist loadfile tests/unit
	$(BIN)/python -m pytest -q -rs -p no:cacheprovider --durations=10 tests/integration tests/e2e

# The opt-in tests (marked slow): the Qwen pair's lossless test, pool scaling, timing bounds.
test-slow: dev
	$(BIN)/specdec models prepare smollm2-135m-instruct $(TARGET) $(DRAFT)
	SPECDEC_SLOW=1 SPECDEC_REQUIRE_ALL=1 $(BIN)/python -m pytest -q -rs -p no:cacheprovider -m slow tests

bench: dev
	$(BIN)/specdec models prepare $(TARGET) $(DRAFT)
	$(BIN)/specdec bench generate --target $(TARGET) --draft $(DRAFT) --dtype bfloat16 \
		--prompts humaneval:8 --max-tokens 128 --budget-s 660 --json bench/out/generate.json

clean-venv:
	rm -rf $(VENV)
