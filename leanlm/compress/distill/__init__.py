"""Knowledge distillation: losses (pure functions), and the trainer that uses them."""
