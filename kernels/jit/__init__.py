"""device code only"""
