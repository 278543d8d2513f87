"""Deployment across sites: ``fl-geo deploy`` (topology, certificates, Flower configuration,
SuperLink/SuperNode processes and their lifecycle) and the HALoS two-tier launcher.
"""
