"""pdserve.kvtransfer.engines: the transfer engines that move bytes (mooncake, nixl, local) behind one TransferEngine interface, and the network device choice."""
