"""Training DFlash drafters: data generation, the recipe, features, the trainer."""
