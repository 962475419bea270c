#!/usr/bin/env bash
# Install and start what the test suite needs from the system, if it is missing:
#   - headers to build mysqlclient (the MariaDB/MySQL driver Django supports);
#   - redis-server and redis-cli, which the Redis tests run themselves;
#   - etcd and etcdctl, which the etcd tests run themselves;
#   - ZooKeeper (Debian's zookeeperd; Java comes with it), which the ZooKeeper tests run themselves;
#   - Chromium, which the admin's browser test drives through Playwright;
#   - PostgreSQL, MariaDB and RabbitMQ answering on loopback.
# Idempotent: on a machine that has everything it only checks.
set -euo pipefail

need_apt=()
pkg-config --exists mysqlclient 2>/dev/null || need_apt+=(default-libmysqlclient-dev pkg-config build-essential)
# The Redis tests start their own redis-server processes (single node, cluster, Redlock).
command -v redis-server >/dev/null || need_apt+=(redis-server)
command -v redis-cli >/dev/null || need_apt+=(redis-tools)
# The etcd tests start their own etcd members and drive `etcdctl lock` (etcd 3.4).
command -v etcd >/dev/null || need_apt+=(etcd-server)
command -v etcdctl >/dev/null || need_apt+=(etcd-client)
# The ZooKeeper tests start their own servers from zookeeperd's zkServer.sh (not its service).
[[ -x /usr/share/zookeeper/bin/zkServer.sh ]] || need_apt+=(zookeeperd)
# The chaos run (make chaos) partitions the network inside namespaces it makes, with iptables.
command -v iptables >/dev/null || need_apt+=(iptables)
# The admin's browser test (tests/test_admin_browser.py) runs /usr/bin/chromium headless.
[[ -x /usr/bin/chromium ]] || need_apt+=(chromium)

if ((${#need_apt[@]})); then
    if [[ $(id -u) -ne 0 ]]; then
        echo "system-deps: missing ${need_apt[*]}; run as root or install them" >&2
        exit 1
    fi
    echo "system-deps: installing ${need_apt[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {
    for _ in $(seq 1 60); do
        port_open "$1" && return 0
        sleep 0.5
    done
    echo "system-deps: nothing answers on port $1" >&2
    return 1
}

if ! port_open 5432 && command -v pg_ctlcluster >/dev/null; then
    echo "system-deps: starting PostgreSQL"
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
    wait_port 5432
fi
# The Celery worker tests run a worker on RabbitMQ too (guest/guest on loopback).
if ! port_open 5672 && command -v rabbitmq-server >/dev/null; then
    echo "system-deps: starting RabbitMQ"
    rabbitmq-server -detached
    wait_port 5672
fi
if ! port_open 3306 && [[ -x /usr/sbin/mariadbd ]]; then
    echo "system-deps: starting MariaDB"
    start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
    wait_port 3306
fi
