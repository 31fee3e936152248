# %postun of vq-controller: reload systemd; on upgrade ($1 >= 1) restart a
# running controller (it is stateless, a restart loses nothing).
if [ -d /run/systemd/system ]; then
    systemctl daemon-reload >/dev/null 2>&1 || :
    if [ "$1" -ge 1 ]; then
        systemctl try-restart vq-controller.service >/dev/null 2>&1 || :
    fi
fi
