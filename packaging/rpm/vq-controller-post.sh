# %post of vq-controller: make systemd see the unit; not enabled or started.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
