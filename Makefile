# vq: the two set-up commands of README.md, plus packaging helpers.
#   make demo   - the demo on the embedded test cloud (root)
#   make test   - every gate and test, including packages-check (root)
#   make packages       - .deb/.rpm of jobagent, vq-controller and vq (the CLI), controller OCI image, in target/packages/ (root)
#   make packages-check - inspect and install-test them (clean Debian root, OCI image against vq-cloudsim)
SHELL := /bin/bash
# Honour CARGO_TARGET_DIR like cargo does.
TARGET_DIR := $(abspath $(or $(CARGO_TARGET_DIR),$(CURDIR)/target))
MUSL_AGENT := $(TARGET_DIR)/x86_64-unknown-linux-musl/release-agent/jobagent

.PHONY: demo test deps static-agent schemas packages packages-check

deps:
	@scripts/ensure-toolchain.sh
	@scripts/ensure-rabbitmq.sh

static-agent: deps
	@scripts/build-static-agent.sh

demo:
	@scripts/require-root.sh demo
	@scripts/demo.sh

test:
	@scripts/require-root.sh test
	@$(MAKE) --no-print-directory static-agent
	@scripts/ensure-chromium.sh
	@scripts/purge-test-broker.sh
	cargo fmt --all -- --check
	@scripts/check-monitoring.sh
	cargo build --locked --workspace --bins
	VQ_JOBAGENT_BIN=$(MUSL_AGENT) cargo test --locked --workspace --no-fail-fast -- --include-ignored
	@scripts/purge-test-broker.sh
	cargo clippy --locked --workspace --all-targets -- -D warnings
	@$(MAKE) --no-print-directory packages-check
	@scripts/purge-test-broker.sh

# Regenerates schemas/*.json from the message and config types.
schemas:
	VQ_BLESS=1 cargo test -p vq-common --test wire --test config

# Every release artefact, into target/packages/ (see README, "Packages and images").
packages:
	@scripts/require-root.sh packages
	@scripts/package-build.sh

packages-check: packages
	@scripts/package-check.sh
