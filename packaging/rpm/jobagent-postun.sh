# %postun of jobagent: reload systemd after the unit changed or went away.
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
fi
