#!/usr/bin/env bash
# Deletes the queues and exchanges that tests leave on the local RabbitMQ
# (clusters named t<10 hex>, vqcli*, vqpkgcheck, bench<N>). Tests use a
# random cluster each and quorum queues and streams are not free: hundreds of
# leftovers slow a small broker down until it stops answering. Run by
# `make test` before and after the tests. Never touches other clusters.
set -euo pipefail
re='^(t[0-9a-f]{10}|vqcli[0-9a-z]*|vqpkgcheck|bench[0-9]+)\\.'
q=$(timeout 120 rabbitmqctl -q eval "length([ok || Q <- rabbit_amqqueue:list(), re:run(element(4, amqqueue:get_name(Q)), <<\"$re\">>) =/= nomatch, begin rabbit_amqqueue:delete(Q, false, false, <<\"vq-test-purge\">>), true end]).")
x=$(timeout 120 rabbitmqctl -q eval "length([ok || X <- rabbit_exchange:list(), re:run(element(4, element(2, X)), <<\"$re\">>) =/= nomatch, begin rabbit_exchange:delete(element(2, X), false, <<\"vq-test-purge\">>), true end]).")
echo "purged test leftovers from RabbitMQ: $q queue(s), $x exchange(s)"
