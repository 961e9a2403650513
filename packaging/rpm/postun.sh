# %postun of rdmad: %systemd_postun_with_restart rdmad.service (on upgrade: restart the
# running service with the new binary), plus a daemon-reload.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
if [ "$1" -ge 1 ]; then
    # Package upgrade, not uninstall
    if [ -x /usr/lib/systemd/systemd-update-helper ]; then
        /usr/lib/systemd/systemd-update-helper mark-restart-system-units rdmad.service || :
    else
        systemctl try-restart rdmad.service >/dev/null 2>&1 || :
    fi
fi
