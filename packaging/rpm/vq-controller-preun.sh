# %preun of vq-controller: on erase ($1 = 0) stop and disable the service.
if [ "$1" -eq 0 ] && [ -d /run/systemd/system ]; then
    systemctl --no-reload disable --now vq-controller.service >/dev/null 2>&1 || :
fi
