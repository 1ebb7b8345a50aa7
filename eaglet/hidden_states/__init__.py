"""Target features for EAGLE-3 training: the backends that compute them (`backends`, one
module per backend behind a registry), the storage forms and the safetensors shards they are
written to."""
