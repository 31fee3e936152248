#!/usr/bin/env bash
# The jobagent switches users, so the demo and the tests run as root.
if [ "$(id -u)" != 0 ]; then
  echo "vq: '$1' needs root (the jobagent switches to each job's owner). Run it as root, e.g. 'sudo make $1'." >&2
  exit 1
fi
