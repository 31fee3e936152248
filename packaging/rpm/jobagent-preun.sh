# %preun of jobagent: on erase ($1 = 0), stop (drains running jobs) and
# disable the agent. On upgrade nothing happens: a running agent keeps its
# jobs; restart it when it is idle (`vq drain`) to run the new binary.
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now jobagent.service >/dev/null 2>&1 || :
fi
