"""Model definitions that the zoo builds but no library ships in the shape we need."""
