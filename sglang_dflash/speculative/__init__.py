"""The DFlash decode step shared by both hosts: block proposal, verify inputs, accept, block penalties."""
