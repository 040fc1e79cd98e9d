"""Ring allreduce over gRPC (see ``trainer.collective.Collective``)."""
