# %post of jobagent: make systemd see the (new) unit. It is not enabled or
# started: an unconfigured agent must not run (see jobagent.service).
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
