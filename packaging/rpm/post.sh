# %post of rdmad: what %systemd_post does on Fedora (the preset decides whether the
# service is enabled; a fresh install does not start it), plus telling systemd and the
# bus about the new unit, policy and activation file.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    dbus-send --system --type=method_call --print-reply --dest=org.freedesktop.DBus \
        /org/freedesktop/DBus org.freedesktop.DBus.ReloadConfig >/dev/null 2>&1 || :
fi
if [ "$1" -eq 1 ]; then
    # Initial installation
    if [ -x /usr/lib/systemd/systemd-update-helper ]; then
        /usr/lib/systemd/systemd-update-helper install-system-units rdmad.service || :
    else
        systemctl --no-reload preset rdmad.service >/dev/null 2>&1 || :
    fi
fi
