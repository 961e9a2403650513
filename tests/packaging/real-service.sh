#!/usr/bin/env bash
# tests/packaging/real-service.sh — the rdmad .deb against a real systemd and system bus.
#
# Runs as root inside the test VM booted with systemd as PID 1
# (`tests/vm/run --systemd`), on a throw-away overlay root, so it may install and purge
# packages freely. scripts/test-package runs it; by hand:
#   tests/vm/run --systemd -- tests/packaging/real-service.sh target/packages/rdmad_*.deb \
#       [path/to/rdmad-test-client]
# Each check prints PASS or FAIL; the last line is "N passed, N failed"; the exit status
# is 1 if any check failed (2 on bad usage).
set -uo pipefail

deb=${1:-}
client_src=${2:-}
[[ -f $deb ]] || { echo "usage: $0 PACKAGE.deb [rdmad-test-client]" >&2; exit 2; }
((EUID == 0)) || { echo "$0: must run as root (in the VM)" >&2; exit 2; }
[[ -d /run/systemd/system ]] || { echo "$0: systemd is not PID 1 here (tests/vm/run --systemd)" >&2; exit 2; }

passed=0 failed=0
t0=$(date +%s%N)
ms() { echo $(( ($(date +%s%N) - t0) / 1000000 )); }
pass() { passed=$((passed + 1)); echo "PASS: $*"; }
fail() { failed=$((failed + 1)); echo "FAIL: $*"; }
# check DESCRIPTION CMD...: PASS if CMD succeeds; on failure its output is shown.
check() {
    local what=$1 out
    shift
    if out=$("$@" 2>&1); then pass "$what"; else fail "$what"; sed 's/^/    | /' <<<"$out"; fi
}
step() { echo "== $* ($(ms) ms)"; }
as_nobody() { setpriv --reuid=nobody --regid=nogroup --clear-groups -- "$@"; }
main_pid() { systemctl show -p MainPID --value rdmad.service; }
reloads() { rdmactl -j status | sed -n 's/.*"reloads":\([0-9]*\).*/\1/p'; }
# wait_for SECONDS CMD...: poll CMD every 0.2 s until it succeeds.
wait_for() {
    local end=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < end)) || return 1
        sleep 0.2
    done
}
journal_has() { journalctl -u rdmad.service --no-pager -o cat | grep -qF -- "$1"; }

step "boot"
state=$(systemctl is-system-running --wait 2>/dev/null)
echo "system state: $state"
if [[ $state == running || $state == degraded ]]; then pass "systemd reached $state"; else fail "systemd state is $state"; fi
[[ $state == degraded ]] && systemctl --failed --no-legend --plain | sed 's/^/    failed unit: /'
check "the system bus is up" busctl --system status org.freedesktop.DBus
have_rxe=0
[[ -e /sys/class/infiniband/rxe0 ]] && have_rxe=1
echo "rxe0 present: $have_rxe"

step "install"
# man-db's dpkg trigger rebuilds its index over 9p: minutes under TCG. Its own switch
# (the flag file) turns it off in this throw-away root; man -w still finds the pages.
rm -f /var/lib/man-db/auto-update
check "dpkg -i $(basename "$deb")" dpkg -i "$deb"
check "rdmad.service is enabled" systemctl is-enabled rdmad.service
check "the postinst started rdmad (active)" wait_for 30 systemctl is-active rdmad.service
systemctl status --no-pager rdmad.service | sed 's/^/    /' | head -12
check "systemd-analyze verify rdmad.service" systemd-analyze verify /usr/lib/systemd/system/rdmad.service
score=$(systemd-analyze security rdmad.service 2>/dev/null | sed -n 's/.*Overall exposure level for rdmad.service: \([0-9.]*\).*/\1/p')
echo "systemd-analyze security rdmad.service (running system): ${score:-?}"
if [[ -n $score ]] && awk -v s="$score" 'BEGIN { exit !(s <= 3.0) }'; then
    pass "security exposure $score <= 3.0"
else
    fail "security exposure ${score:-unknown} > 3.0"
fi
check "/etc/rdmad/rdmad.toml is a conffile" grep -qx ' /etc/rdmad/rdmad.toml [0-9a-f]*' <(dpkg-query -W -f='${Conffiles}\n' rdmad)
check "man rdmad.toml(5) is installed" man -w 5 rdmad.toml
check "bash completion is installed" test -s /usr/share/bash-completion/completions/rdmactl

step "systemctl start, rdmactl as a normal user"
check "systemctl restart rdmad" systemctl restart rdmad.service
check "rdmad.service is active" systemctl is-active rdmad.service
out=$(as_nobody rdmactl status 2>&1)
rc=$?
sed 's/^/    /' <<<"$out"
if ((rc == 0)) && grep -q '0\.1\|version' <<<"$out"; then pass "rdmactl status as nobody over the system bus"; else fail "rdmactl status as nobody (exit $rc)"; fi
devs=$(as_nobody rdmactl -j status 2>&1)
if ((have_rxe)); then
    check "rdmad serves rxe0 under the hardened unit" grep -q '"rxe0"' <<<"$devs"
else
    check "rdmad serves a device" grep -q '"devices":\["' <<<"$devs"
fi
check "rdmactl dev show as nobody" as_nobody rdmactl dev show
# ibv_devices prints "    %-16s\t%016llx": the name padded with spaces, then a tab.
verbs=$(as_nobody rdmactl exec -- ibv_devices 2>&1)
sed 's/^/    /' <<<"$verbs"
check "an unmodified verbs program runs through the installed rdmad (rdmactl exec -- ibv_devices as nobody)" \
    grep -qE '^ +(rxe0|loopback0)[[:space:]]+[0-9a-f]{16}$' <<<"$verbs"
if [[ -n $client_src && -x $client_src ]]; then
    # A region: memfd created by the daemon, registered on the device, mapped by the
    # client through the fd passed over the bus, written and read back.
    install -m 0755 "$client_src" /usr/local/bin/rdmad-test-client
    out=$(printf 'open\nalloc default 65536\nwrite 0 0 hello-rdmad\nread 0 0 11\nfree 0\nclose\nexit\n' \
        | as_nobody env RDMAD_BUS_ADDRESS=unix:path=/run/dbus/system_bus_socket rdmad-test-client 2>&1)
    sed 's/^/    /' <<<"$out"
    check "a normal user allocates, maps, writes and reads a region" grep -q '"ok":"hello-rdmad"' <<<"$out"
else
    echo "    (no rdmad-test-client given: region round trip not checked)"
fi

step "D-Bus activation"
check "systemctl stop rdmad" systemctl stop rdmad.service
check "rdmad.service is inactive after stop" bash -c '! systemctl is-active -q rdmad.service'
check "the first call (rdmactl status as nobody) starts rdmad through the bus" as_nobody rdmactl status
check "rdmad.service is active again (activated)" systemctl is-active rdmad.service
check "the journal shows the activation request" bash -c \
    "journalctl --no-pager -o cat -u dbus.service | grep -q \"Activating via systemd: service name='org.rdmad1'\""

step "systemctl reload"
pid=$(main_pid)
n=$(reloads)
echo "    MainPID $pid, reloads $n"
cp /etc/rdmad/rdmad.toml /tmp/rdmad.toml.orig
sed -i 's/^#log_level = "info"/log_level = "debug"/' /etc/rdmad/rdmad.toml
check "the edited configuration is valid (rdmad --check-config)" rdmad --check-config --config /etc/rdmad/rdmad.toml
check "systemctl reload rdmad (valid file)" systemctl reload rdmad.service
check "the reload is applied (reloads $n -> $((n + 1)))" wait_for 15 test "$(reloads)" = "$((n + 1))"
check "rdmad logged 'configuration reloaded'" wait_for 5 journal_has "configuration reloaded"
check "same process after the reload" test "$(main_pid)" = "$pid"
echo 'no_such_key = 1' >>/etc/rdmad/rdmad.toml
check "rdmad --check-config refuses the broken file" bash -c '! rdmad --check-config --config /etc/rdmad/rdmad.toml'
systemctl reload rdmad.service
check "rdmad logged that the broken file was refused" wait_for 15 journal_has "configuration not reloaded"
check "rdmad.service is still active" systemctl is-active rdmad.service
check "same process after the refused reload" test "$(main_pid)" = "$pid"
check "the reload count did not move ($((n + 1)))" test "$(reloads)" = "$((n + 1))"
check "rdmactl status still works as nobody" as_nobody rdmactl status
check "rdmactl reload is refused for nobody" bash -c '! setpriv --reuid=nobody --regid=nogroup --clear-groups -- rdmactl reload'
cp /tmp/rdmad.toml.orig /etc/rdmad/rdmad.toml

step "journal"
journalctl -u rdmad.service --no-pager -o cat | tail -n 8 | sed 's/^/    /'
json=$(journalctl -u rdmad.service --no-pager -o json)
check "journal entries carry SYSLOG_IDENTIFIER=rdmad" grep -q '"SYSLOG_IDENTIFIER":"rdmad"' <<<"$json"
check "journal entries carry structured fields (F_BUS=system on 'ready')" grep -q '"F_BUS":"system"' <<<"$json"
check "journal entries carry the source location (CODE_FILE)" grep -q '"CODE_FILE":' <<<"$json"
check "levels map to journal priorities (info entries at PRIORITY=6)" grep -q '"PRIORITY":"6"' <<<"$json"

step "remove"
check "dpkg -r rdmad" dpkg -r rdmad
check "rdmad.service is not active after removal" bash -c '! systemctl is-active -q rdmad.service'
check "no rdmad process is left" bash -c '! pgrep -x rdmad'
check "the binaries, unit and bus files are gone" bash -c '! ls /usr/sbin/rdmad /usr/bin/rdmactl /usr/lib/systemd/system/rdmad.service /usr/share/dbus-1/system.d/org.rdmad1.conf /usr/share/dbus-1/system-services/org.rdmad1.service 2>/dev/null | grep -q .'
check "the conffile stays after remove (Debian policy)" test -f /etc/rdmad/rdmad.toml
check "dpkg keeps the package as config-files" test "$(dpkg-query -W -f='${Status}' rdmad)" = "deinstall ok config-files"
check "a D-Bus call no longer starts anything" bash -c '! setpriv --reuid=nobody --regid=nogroup --clear-groups -- rdmactl status && ! systemctl is-active -q rdmad.service'

step "purge"
check "dpkg -P rdmad" dpkg -P rdmad
check "/etc/rdmad is gone after purge" test ! -e /etc/rdmad
left=$(find /etc /usr/bin /usr/sbin /usr/lib/systemd /usr/share/dbus-1 /usr/share/man \
    /usr/share/doc /usr/share/bash-completion /usr/share/zsh /usr/share/fish \
    /var/lib/systemd /run/systemd/system -name '*rdmad*' ! -name 'rdmad-vm*' 2>/dev/null)
if [[ -z $left ]]; then pass "no rdmad file is left anywhere after purge"; else fail "left after purge:"; sed 's/^/    | /' <<<"$left"; fi
check "dpkg no longer knows rdmad" bash -c '! dpkg-query -W -f="\${Status}" rdmad 2>/dev/null | grep -q installed'
units=$(systemctl list-units --all --no-legend --plain 'rdmad.*' 'dbus-org.rdmad1.*' 2>/dev/null)
if [[ -z $units ]]; then pass "systemd has no rdmad unit loaded"; else fail "systemd still lists: $units"; fi

echo "== done in $(ms) ms"
echo "$passed passed, $failed failed"
((failed == 0))
