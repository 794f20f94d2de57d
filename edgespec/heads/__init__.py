"""Heads that draft from the target's hidden states: Medusa, EAGLE, EAGLE-3, MTP."""
