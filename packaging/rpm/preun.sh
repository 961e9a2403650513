# %preun of rdmad: %systemd_preun rdmad.service (on removal, not upgrade: disable and stop).
if [ "$1" -eq 0 ]; then
    # Package removal, not upgrade
    if [ -x /usr/lib/systemd/systemd-update-helper ]; then
        /usr/lib/systemd/systemd-update-helper remove-system-units rdmad.service || :
    else
        systemctl --no-reload disable --now rdmad.service >/dev/null 2>&1 || :
    fi
fi
