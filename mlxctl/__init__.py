"""mlxctl: the control CLI of mlxceld. It talks only to the local daemon."""
