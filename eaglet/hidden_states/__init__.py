"""Target features for EAGLE-3 training: backends that compute them, the storage forms and the
safetensors shards they are written to."""
