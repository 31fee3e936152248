# %pre of vq-controller: the system user and group `vq` the service runs as
# (the config file is installed root:vq 0640).
getent group vq >/dev/null || groupadd --system vq
getent passwd vq >/dev/null || useradd --system --gid vq --home-dir /nonexistent \
    --no-create-home --shell /sbin/nologin --comment "vq controller" vq
exit 0
