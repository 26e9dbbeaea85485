"""Knowledge distillation: losses (pure functions), the trainer that uses them, QAT, the recipe step, and the
teacher-written corpora of black-box distillation (data)."""
