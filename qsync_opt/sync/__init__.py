"""How replicas agree while training: DDP, Local SGD under the QSR rule, the gradient-transport hook and DLCP's masks."""
